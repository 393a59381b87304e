"""Every GGUF metadata field that changes an EAGLE-3 drafter's math in llama.cpp, checked against
the checkpoint config it was converted from and the target; and the file's bytes against the
digest recorded when eyas exported it.

The fields are what ``src/llama-model.cpp`` ``load_hparams`` (the keys every architecture reads)
and ``src/models/eagle3.cpp`` (``load_arch_hparams``, ``load_arch_tensors``, the graph) read in
``ggml-org/llama.cpp`` as vendored in ``llama-cpp-python`` 0.3.36, with llama.cpp's default when
absent (:data:`FIELDS`, keys without the ``eagle3.`` prefix). RoPE is compared as the inverse
frequencies llama.cpp computes (``ggml_rope_ext``: ``freq_scale * freq_base^(-2i/n_rot) /
rope_freqs[i]``, ``freq_scale`` = 1 / ``rope.scaling.factor``; the converter writes llama3
scaling as the ``rope_freqs.weight`` tensor, ``conversion/llama.py``
``LlamaModel.generate_extra_tensors``) against eyas' (eyas.target.rope.inv_freq): one comparison
covers theta, the scaling type, factor, low/high frequency factors and original context length.
A scaling type llama.cpp applies that eyas does not (yarn, longrope) and a RoPE attention factor
other than 1 are refused by name. ``target_layers``, ``target_hidden_size``, the norm flags and
d2t are checked by :func:`eyas.export.gguf.check_against` itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.io import sha256_file, write_text
from eyas.target import hf_config, rope

_LOAD = "src/llama-model.cpp load_hparams"
_E3 = "src/models/eagle3.cpp"


def _heads(m: dict) -> int | None:
    return m.get("attention.head_count")


def _head_dim(m: dict) -> int | None:
    H, n = m.get("embedding_length"), _heads(m)
    return m.get("attention.key_length", H // n if H and n else None)


FIELDS: tuple[tuple[str, object, str, str], ...] = (
    # (GGUF key, llama.cpp's value when absent (a callable of the metadata), config key, where llama.cpp reads it)
    ("embedding_length", None, "hidden_size", _LOAD),
    ("feed_forward_length", None, "intermediate_size", _LOAD),
    ("attention.head_count", None, "num_attention_heads", _LOAD),
    ("attention.head_count_kv", _heads, "num_key_value_heads", _LOAD + " (absent: head_count)"),
    ("attention.key_length", _head_dim, "head_dim", _LOAD + " (absent: embedding_length / head_count)"),
    ("attention.value_length", _head_dim, "head_dim", _LOAD + " (absent: embedding_length / head_count)"),
    ("rope.dimension_count", lambda m: m.get("attention.key_length", _head_dim(m)), "head_dim",
     _LOAD + " (n_rot; eyas rotates the whole head)"),
    ("attention.layer_norm_rms_epsilon", None, "rms_norm_eps", _E3 + " load_arch_hparams"),
    ("context_length", None, "max_position_embeddings", _LOAD + " (n_ctx_train)"),
    ("vocab_size", None, "vocab_size", "conversion/llama.py (the width draft logits are scattered into)"),
    ("attention.causal", lambda m: True, None, _LOAD + " (false: bidirectional attention)"),
    ("rope.scaling.attn_factor", lambda m: 1.0, None, _LOAD + " (scales the rotated q and k)"),
)
"""The scalar fields; RoPE frequencies are :func:`served_inv_freq`."""

_CFG_VALUE = {
    "num_key_value_heads": hf_config.num_key_value_heads,
    "head_dim": hf_config.head_dim,
}
_EYAS_VALUE = {"attention.causal": True, "rope.scaling.attn_factor": 1.0}  # what eyas' drafter computes with


def served_value(info: dict, key: str):
    """The value llama.cpp uses for ``key`` (a :data:`FIELDS` key) of a :func:`eyas.export.gguf.read_drafter`
    dict: the file's, else llama.cpp's default (None: no default, the key is required)."""
    m = info["metadata"]
    if key in m:
        return m[key]
    default = next(d for k, d, _, _ in FIELDS if k == key)
    return default(m) if callable(default) else default


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):  # GGUF floats are float32: compare at that precision
        return a is not None and b is not None and \
            torch.tensor(float(a), dtype=torch.float32) == torch.tensor(float(b), dtype=torch.float32)
    return a == b


def served_inv_freq(info: dict) -> tuple[torch.Tensor | None, str]:
    """llama.cpp's RoPE inverse frequencies for a drafter GGUF: ([n_rot // 2] float64 radians per
    position, or None where eyas has no equal; a one-line description of the fields used).

    ``freq_base`` (``rope.freq_base``, absent 10000), ``rope.scaling.type`` (absent ``linear``),
    ``rope.scaling.factor`` (else the older ``rope.scale_linear``; absent or 0: 1), the
    ``rope_freqs.weight`` tensor (absent: ones), as ``src/llama-model.cpp`` load_hparams and
    ``src/models/eagle3.cpp`` (``model.get_rope_factors``) read them.
    """
    m = info["metadata"]
    n_rot = served_value(info, "rope.dimension_count")
    base = float(m.get("rope.freq_base", 10000.0))
    stype = m.get("rope.scaling.type", "linear")
    factor = float(m.get("rope.scaling.factor", m.get("rope.scale_linear", 0.0)) or 0.0)
    scale = 1.0 if factor == 0.0 else 1.0 / factor
    ff = info.get("reader_tensors", {}).get("rope_freqs.weight")
    desc = (f"rope.freq_base {base:g}, rope.scaling.type {stype}, rope.scaling.factor {factor:g}, "
            f"rope_freqs.weight {'present' if ff is not None else 'absent'}")
    if stype not in ("none", "linear") or not n_rot:
        return None, desc
    if stype == "none":
        scale = 1.0
    inv = scale * base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)
    if ff is not None:
        import numpy as np

        factors = torch.from_numpy(np.asarray(ff.data, dtype=np.float64).reshape(-1).copy())
        if factors.numel() != inv.numel():
            return None, desc + f" ({factors.numel()} factors for {inv.numel()} frequencies)"
        inv = inv / factors
    return inv, desc


def _rope_problem(where: str, info: dict, cfg, src: str) -> str | None:
    """The GGUF's RoPE frequencies against ``cfg``'s (a config dict or a target summary)."""
    inv, desc = served_inv_freq(info)
    try:
        theta, scaling = rope.normalise(cfg, source=src)
        want = rope.inv_freq(hf_config.head_dim(cfg), theta, scaling).to(torch.float64)
    except (rope.RopeError, KeyError) as e:
        return f"{where}: cannot compare RoPE ({desc}) with {src}: {e}"
    line = rope.describe(theta, scaling)
    if inv is None:
        return (f"{where}: RoPE {desc}: llama.cpp applies a RoPE eyas does not implement; {src} has {line} "
                f"({_LOAD})")
    if inv.numel() != want.numel():
        return f"{where}: RoPE over {2 * inv.numel()} dimensions, {src} rotates {2 * want.numel()} ({line})"
    ratio = (inv / want).sub(1).abs()
    if bool((ratio > 1e-4).any()):
        i = int(ratio.argmax())
        n = int((ratio > 1e-4).sum())
        return (f"{where}: RoPE {desc}: llama.cpp's frequencies differ from {src}'s ({line}) at {n}"
                f" of {inv.numel()} dimensions, up to {max(inv[i] / want[i], want[i] / inv[i]):.3g}x at dimension "
                f"{2 * i}: the drafter would attend over other positions than it was trained on ({_LOAD}, {_E3})")
    return None


def field_problems(info: dict, cfg: dict, src: str) -> list[str]:
    """Every :data:`FIELDS` value and the RoPE frequencies of a drafter GGUF (:func:`eyas.export.gguf.read_drafter`)
    that differ from the checkpoint config ``cfg`` (flat: the speculators layout's
    ``transformer_layer_config`` merged in) it was converted from, or from eyas' drafter.

    Returns:
        One message per field, naming the GGUF file, the key, both values and where llama.cpp reads it.
    """
    where, out = info["path"], []
    for key, _, ckey, reads in FIELDS:
        got = served_value(info, key)
        if ckey is None:
            want, what = _EYAS_VALUE[key], "eyas' drafter"
        else:
            try:
                want = _CFG_VALUE[ckey](cfg) if ckey in _CFG_VALUE else cfg.get(ckey)
            except KeyError:
                want = None
            what = f"{src} {ckey}"
            if want is None:
                continue
        if not _same(got, want):
            out.append(f"{where}: eagle3.{key} {got!r} != {what} {want!r}: llama.cpp would serve another drafter "
                       f"function than the one trained ({reads})")
    if (p := _rope_problem(where, info, cfg, src)) is not None:
        out.append(p)
    return out


def target_field_problems(info: dict, target: dict) -> list[str]:
    """The GGUF's RoPE frequencies and context length against the target's summary
    (``eyas.target.model.summarise_config``): eyas gives a drafter its target's positions
    (eyas.vocab.remap.adopt_target_positions, the scratch drafter's config)."""
    where, out = info["path"], []
    ctx, want = served_value(info, "context_length"), target.get("max_position_embeddings")
    if want is not None and ctx != want:
        out.append(f"{where}: eagle3.context_length {ctx!r} != the target's max_position_embeddings {want!r} ({_LOAD})")
    if target.get("head_dim") or (target.get("hidden_size") and target.get("num_attention_heads")):
        # the target's own head size differs from the drafter's: compare at the drafter's head_dim
        t = {**target, "head_dim": served_value(info, "rope.dimension_count")}
        if (p := _rope_problem(where, info, t, "the target")) is not None:
            out.append(p)
    return out


DIGEST_SUFFIX = ".sha256"
"""The digest beside an exported GGUF: ``<file>.gguf.sha256``, in ``sha256sum`` format (``sha256sum -c`` checks it)."""


def digest_path(path: str | Path) -> Path:
    """Where the digest of the GGUF at ``path`` is kept."""
    path = Path(path)
    return path.with_name(path.name + DIGEST_SUFFIX)


def write_digest(path: str | Path, name: str | None = None) -> str:
    """Record the SHA-256 of the file at ``path`` in :func:`digest_path` of ``name`` (default
    ``path``), atomically, as ``<hex>  <file name>``. Returns the hex digest."""
    hexd = sha256_file(path)
    dest = digest_path(name or path)
    write_text(dest, f"{hexd}  {dest.name.removesuffix(DIGEST_SUFFIX)}\n")
    return hexd


def digest_problem(path: str | Path) -> str | None:
    """Why the GGUF at ``path`` is not the file eyas exported (no digest recorded beside it, or its
    bytes hash to another SHA-256: changed after export), or ``None``."""
    path, d = Path(path), digest_path(path)
    if not d.is_file():
        return (f"{path}: no digest recorded at export ({d} is missing): eyas cannot tell this file is the one it "
                f"converted and checked; export it again")
    recorded = d.read_text().split()[0] if d.read_text().split() else ""
    actual = sha256_file(path)
    if actual != recorded:
        return (f"{path}: its bytes changed after export (SHA-256 {actual[:16]}..., {d} recorded "
                f"{recorded[:16] or 'nothing'}...): a damaged copy or an edited file; export it again")
    return None

