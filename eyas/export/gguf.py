"""GGUF files for llama.cpp: an eyas drafter as llama.cpp's ``eagle3`` architecture, and the target
at the precision eyas evaluates it, both written by llama.cpp's own converter.

The converter is ``convert_hf_to_gguf.py`` of the llama.cpp sources vendored in the PyPI sdist of
``llama-cpp-python`` that ``scripts/build_llama_server.sh`` also builds ``llama-server`` from
(installed beside it under ``<python data dir>/share/eyas/llama.cpp``), so the file layout is the
engine's own (ggml-org/llama.cpp ``conversion/llama.py``, EAGLE-3 support from PR #18039): eyas
re-implements none of it. The drafter conversion reads the target's ``config.json`` and tokenizer
through ``--target-model-dir`` (:func:`write_target_dir` writes them for any target eyas loads).

:func:`read_drafter` reads such a file back (the PyPI ``gguf`` package's ``GGUFReader``) as
llama.cpp will load it, and :func:`check_against` compares it with what the drafter was trained on
(its checkpoint directory, the features' aux layers, the pipeline's vocab) before it is served.
The meaning of the file's ``eagle3.target_layers`` is llama.cpp's (``common/speculative.cpp``,
``common_speculative_impl_draft_eagle3``): an id ``k`` below the target's layer count L captures
the INPUT of target layer ``k`` (= HF ``hidden_states[k]``), ``k == L`` whatever the target's
graph writes to its ``t_h_nextn`` buffer: the state before the final norm (what eyas captures for
id ``L``, eyas.target.layers.capture_aux) only on a few architectures, after it on others, and
nothing at all on most, Llama and Qwen3 among them (eyas.export.llamacpp_nextn, which
:func:`check_against` refuses by), ``k > L`` aborts; exactly three ids, concatenated in the order
written. Every other field that changes the math is checked by eyas.export.gguf_fields, and the
file's bytes against the digest :func:`convert` records.

One module past 500 lines: a drafter GGUF's whole round trip, written by llama.cpp's converter, read
back as llama.cpp loads it and checked against every source of what it was trained on, shares the
file's keys and llama.cpp's meaning of them; the field-by-field checks and the digest live in
eyas/export/gguf_fields.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.export.engine_keys import INT_LIST, POS_INT, has_type, read_config
from eyas.export.gguf_fields import digest_problem, field_problems, target_field_problems, write_digest
from eyas.export.llamacpp_nextn import id_l_problem
from eyas.io import open_safetensors, read_json, write_json
from eyas.target import layers

CONVERTER = Path(sysconfig.get_path("data"), "share", "eyas", "llama.cpp", "convert_hf_to_gguf.py")
"""llama.cpp's converter as ``scripts/build_llama_server.sh`` installs it."""


OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""The converter's ``--outtype`` for each ``target.dtype``: the precision eyas evaluates at."""


class GGUFExportError(RuntimeError):
    """The converter is missing or failed; the message names the input and the converter's last lines."""


def write_target_dir(model, tokenizer, out: Path, weights: bool = False) -> Path:
    """Write the target's ``config.json`` and tokenizer files (transformers ``save_pretrained``) into
    ``out``: what the converter's ``--target-model-dir`` reads for an EAGLE-3 drafter (the vocab,
    the layer count, the hidden size). With ``weights`` also the model's weights as safetensors, in
    the dtype the model holds (the input of :func:`convert` for the target itself; a tied lm_head is left
    out, and the converter ties it again).

    Args:
        model: a transformers causal LM (``eyas.target.model.Target.model``).
        tokenizer: its tokenizer (``Target.tokenizer``).
        out: a directory; created, files in it overwritten.
    Returns:
        ``out``.
    """
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # a GGUF source: the weights written here are de-quantised
    cfg["architectures"] = [type(model).__name__]  # the converter picks its model class by it
    write_json(out / "config.json", cfg)
    tokenizer.save_pretrained(out)
    if weights:  # transformers will not save_pretrained a model it de-quantised from a GGUF
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):  # the converter ties a missing lm_head
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def convert(model_dir: Path, out: Path, outtype: str = "f32", target_model_dir: Path | None = None) -> Path:
    """Run llama.cpp's converter on an HF-layout directory and write ``out`` atomically (a
    ``.part`` file renamed when the converter succeeds).

    Args:
        model_dir: a drafter directory (eyas' eagle layout or the speculators layout: both are read
            by ``conversion/llama.py``) or a target written by :func:`write_target_dir`.
        out: the GGUF file to write.
        outtype: the converter's ``--outtype`` (``f32``, ``f16``, ``bf16``, ``q8_0``).
        target_model_dir: required for a drafter (the converter's ``--target-model-dir``).
    Returns:
        ``out``, with the SHA-256 of its bytes recorded beside it
        (:func:`eyas.export.gguf_fields.write_digest`: ``<out>.sha256``), which
        :func:`require_served_as_trained` checks before it is served.
    Raises:
        GGUFExportError: the converter is not installed (run ``bash scripts/build_llama_server.sh``),
            or it exited non-zero (the message names ``model_dir`` and holds its last output lines).
    """
    if not CONVERTER.is_file():
        raise GGUFExportError(f"llama.cpp's converter is not installed at {CONVERTER}: "
                              "run `bash scripts/build_llama_server.sh`")
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    cmd = [sys.executable, str(CONVERTER), str(model_dir), "--outfile", str(part), "--outtype", outtype]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if r.returncode != 0 or not part.is_file():
        part.unlink(missing_ok=True)
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise GGUFExportError(f"{model_dir}: llama.cpp's converter exited {r.returncode}:\n{tail}")
    write_digest(part, name=out)  # recorded before the file takes its name: a later change is caught
    os.replace(part, out)
    return out


ARCHITECTURE = "eagle3"
"""``general.architecture`` of an EAGLE-3 drafter GGUF (ggml-org/llama.cpp ``src/llama-arch.cpp``)."""

_SPECULATIVE = "common/speculative.cpp"
_EAGLE3_CPP = "src/models/eagle3.cpp"


GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file (ggml-org/ggml ``docs/gguf.md``)."""


class GGUFReadError(ValueError):
    """A GGUF file cannot be parsed, or is not an EAGLE-3 drafter llama.cpp would load; the
    message names the file and the key."""


def _value(field):
    """A GGUF metadata value as Python (``str``, ``int``, ``float``, ``bool`` or a list of them),
    from the ``parts``/``data`` view every ``gguf`` release since 0.10 has."""
    from gguf import GGUFValueType

    def one(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        # a float32 as written (1e-05), not widened (9.999999747378752e-06)
        return float(str(part[0])) if vtype == GGUFValueType.FLOAT32 else part[0].item()

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def describe_target_layers(ids: list[int], num_target_layers: int | None) -> list[str]:
    """What llama.cpp captures for each of a drafter's ``eagle3.target_layers`` ids on a target of
    ``num_target_layers`` decoder layers (ggml-org/llama.cpp ``common/speculative.cpp``,
    ``common_speculative_impl_draft_eagle3``): one line per id, in concatenation order."""
    L = num_target_layers
    out = []
    for k in ids:
        if L is None:
            out.append(f"{k}: the input of target layer {k} (= HF hidden_states[{k}]) if {k} < L; "
                       f"L unknown (pass the target's layer count)")
        elif 0 <= k < L:
            out.append(f"{k}: the input of target layer {k} = output of layer {k - 1} = HF hidden_states[{k}]"
                       if k else f"{k}: the input of target layer 0 (the embedding) = HF hidden_states[0]")
        elif k == L:
            out.append(f"{k}: the target graph's t_h_nextn buffer: the state before the final norm only on the "
                       f"architectures eyas.export.llamacpp_nextn.PRE_NORM lists (never filled on llama, qwen3)")
        else:
            out.append(f"{k}: beyond the target's {L} layers: llama.cpp aborts")
    return out


def converter_target_layers(config: dict, num_target_layers: int | None) -> list[int] | None:
    """The ``eagle3.target_layers`` llama.cpp's converter writes for a drafter ``config.json``
    dict (ggml-org/llama.cpp ``conversion/llama.py``, ``LlamaModel.__init__``): the TOP-LEVEL
    ``eagle_aux_hidden_state_layer_ids`` verbatim when set and non-empty, else ``[2, L//2, L-3]``
    of the target's ``num_hidden_layers`` (``--target-model-dir``); the SGLang form nested in
    ``eagle_config`` is not read. ``None`` when the config has no ids and L is unknown."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return list(ids)
    return None if num_target_layers is None else layers.default_hf_indices(num_target_layers)


def read_drafter(path: str | Path) -> dict:
    """Read an EAGLE-3 drafter GGUF as llama.cpp loads it (``src/models/eagle3.cpp``
    ``load_arch_hparams`` / ``load_arch_tensors``), with the PyPI ``gguf`` package's ``GGUFReader``.

    Args:
        path: a ``.gguf`` file written by :func:`convert` (or any llama.cpp ``eagle3`` GGUF).
    Returns:
        A dict: ``path``; ``architecture`` (``"eagle3"``); ``target_layers`` (list of int, llama.cpp
        ids: see the module docstring); ``target_hidden_size`` (int; the fc input is 3 x it);
        ``norm_before_residual`` / ``norm_before_fc`` (bool; absent = False, llama.cpp's default);
        ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim`` (``attention.key_length``, else hidden / heads),
        ``rms_norm_eps``, ``rope_freq_base``, ``context_length``, ``vocab_size``
        (``eagle3.vocab_size``); ``n_tokens`` (entries of the embedded tokenizer: the width
        llama.cpp scatters draft logits into; ``None`` without one); ``tokenizer`` (``model``,
        ``pre``, ``bos_token_id``, ``eos_token_id``); ``draft_vocab_size`` (d2t's length, ``None``
        without a d2t: llama.cpp then serves the full vocab); ``d2t`` (torch.int64 [draft_vocab]
        ABSOLUTE target ids, as the converter writes them: eyas' offsets + arange; ``None``
        without one); ``own_embedding`` / ``own_lm_head`` (``token_embd.weight`` /
        ``output.weight`` in the file; without them llama.cpp uses the target's); ``metadata``
        (every ``eagle3.*`` key, prefix dropped, e.g. ``rope.scaling.type``); ``tensors``
        (name -> ``{"shape": [...] in torch order, "type": "F32" ...}``); ``reader_tensors``
        (name -> the reader's tensor, its data mapped from the file: :func:`check_against`
        compares weights through it instead of parsing the file again); ``problems`` (what
        llama.cpp would refuse at load or serve wrongly, judged from the file alone: not 3 target
        layers, more than one block, an fc width other than 3 x target_hidden_size, a d2t that
        is not int64, longer or shorter than ``output.weight``'s rows, with an id outside
        ``[0, n_tokens)`` or repeated).
    Raises:
        FileNotFoundError: no file at ``path``.
        GGUFReadError: a GGUF file cut short (called truncated), not a GGUF file (another format),
            ``general.architecture`` is
            not ``eagle3`` (a target GGUF, a plain Llama), or it lacks ``eagle3.target_layers``
            (llama.cpp refuses to load it); each names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    info = _drafter_fields(path, _open_gguf(path))
    problems = _shape_problems(info)
    d2t = None
    if (t := info["reader_tensors"].get("d2t")) is not None:
        d2t = _read_d2t(t)
        problems += _file_d2t_problems(info, t, d2t)
    info["d2t"] = d2t
    info["draft_vocab_size"] = None if d2t is None else d2t.numel()
    info["problems"] = problems
    return info


def _drafter_fields(path: Path, reader) -> dict:
    """:func:`read_drafter`'s dict from a ``GGUFReader`` of ``path``, less ``d2t``,
    ``draft_vocab_size`` and ``problems``.

    Raises:
        GGUFReadError: ``general.architecture`` is not ``eagle3``, or no ``eagle3.target_layers``.
    """
    fields = reader.fields

    def get(key, default=None):
        return _value(fields[key]) if key in fields else default

    arch = get("general.architecture")
    if arch != ARCHITECTURE:
        raise GGUFReadError(f"{path}: general.architecture is {arch!r}, not {ARCHITECTURE!r}: not an EAGLE-3 drafter "
                            f"(llama.cpp's --spec-type draft-eagle3 loads only an {ARCHITECTURE} GGUF as -md)")
    a = ARCHITECTURE + "."
    target_layers = get(a + "target_layers")
    if target_layers is None:
        raise GGUFReadError(f"{path}: no {a}target_layers: llama.cpp refuses to load it "
                            f"({_EAGLE3_CPP} load_arch_hparams requires them)")
    tensors = {t.name: t for t in reader.tensors}
    H, th = get(a + "embedding_length"), get(a + "target_hidden_size")
    heads = get(a + "attention.head_count")
    tokens = fields.get("tokenizer.ggml.tokens")
    return {
        "path": str(path),
        "architecture": arch,
        "target_layers": [int(k) for k in target_layers],
        "target_hidden_size": th,
        "norm_before_residual": bool(get(a + "norm_before_residual", False)),
        "norm_before_fc": bool(get(a + "norm_before_fc", False)),
        "hidden_size": H,
        "intermediate_size": get(a + "feed_forward_length"),
        "num_hidden_layers": get(a + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get(a + "attention.head_count_kv", heads),
        "head_dim": get(a + "attention.key_length", H // heads if H and heads else None),
        "rms_norm_eps": get(a + "attention.layer_norm_rms_epsilon"),
        "rope_freq_base": get(a + "rope.freq_base"),
        "context_length": get(a + "context_length"),
        "vocab_size": get(a + "vocab_size"),
        "n_tokens": None if tokens is None else len(tokens.data),
        "tokenizer": {k: get("tokenizer.ggml." + k) for k in ("model", "pre", "bos_token_id", "eos_token_id")},
        "own_embedding": "token_embd.weight" in tensors,
        "own_lm_head": "output.weight" in tensors,
        "metadata": {k.removeprefix(a): _value(f) for k, f in fields.items() if k.startswith(a)},
        "tensors": {n: {"shape": [int(x) for x in reversed(t.shape.tolist())], "type": t.tensor_type.name}
                    for n, t in tensors.items()},
        "reader_tensors": tensors,
    }


def _open_gguf(path: Path):
    """The PyPI ``gguf`` package's ``GGUFReader`` of ``path``, its tensors checked to end inside the file.

    Raises:
        GGUFReadError: a GGUF file cut short (called truncated: its header or its tensors run past the
            end) or not a GGUF file (another format); each names the file.
    """
    from gguf import GGUFReader

    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 -- the reader raises ValueError, IndexError... on a foreign file
        if magic == GGUF_MAGIC:  # a GGUF header that runs past the end of the file
            raise GGUFReadError(f"{path}: a GGUF file cut short (truncated: {size:,} bytes, the gguf package "
                                f"reads past the end: {type(e).__name__}: {e}); a copy or download that did not "
                                f"finish: export or copy it again") from None
        raise GGUFReadError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r}; the gguf package: "
                            f"{type(e).__name__}: {e})") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GGUFReadError(f"{path}: a GGUF file cut short (truncated: {size:,} bytes, its tensors end at byte "
                            f"{end:,}); export or copy it again")
    return reader


def _shape_problems(info: dict) -> list[str]:
    """What llama.cpp refuses at load in :func:`read_drafter`'s ``info`` (before its ``d2t``): not 3
    target layers, more than one block, an ``fc.weight`` other than [hidden, 3 x target_hidden_size]
    (torch order); each names the file, the key and ``src/models/eagle3.cpp``."""
    path, a = info["path"], ARCHITECTURE + "."
    H, th = info["hidden_size"], info["target_hidden_size"]
    problems = []
    ids = info["target_layers"]
    if len(ids) != 3:
        problems.append(f"{path}: {a}target_layers {ids} holds {len(ids)} ids: llama.cpp requires exactly 3 "
                        f"({_EAGLE3_CPP} load_arch_hparams refuses the file)")
    if info["num_hidden_layers"] != 1:
        problems.append(f"{path}: {a}block_count {info['num_hidden_layers']}: llama.cpp's EAGLE-3 graph has "
                        f"exactly one decoder layer ({_EAGLE3_CPP} asserts n_layer == 1)")
    fc = info["tensors"].get("fc.weight")
    if fc is None or (th and H and fc["shape"] != [H, len(ids) * th]):
        problems.append(f"{path}: fc.weight {'missing' if fc is None else fc['shape']}, llama.cpp expects "
                        f"[{H}, {len(ids)} x {a}target_hidden_size {th}] ({_EAGLE3_CPP} load_arch_tensors)")
    return problems


def _read_d2t(t) -> torch.Tensor:
    """A GGUF ``d2t`` tensor (the reader's, its data mapped from the file) as torch.int64 [draft_vocab]
    absolute target ids, copied out of the mapping."""
    import numpy as np

    return torch.from_numpy(np.asarray(t.data).astype(np.int64).reshape(-1).copy())


def _file_d2t_problems(info: dict, t, d2t: torch.Tensor) -> list[str]:
    """What llama.cpp refuses or serves wrongly in a GGUF's d2t (``t``: the reader's tensor; ``d2t``:
    it as torch.int64 [draft_vocab] absolute target ids), judged from the file alone: not I64, another
    length than ``output.weight``'s rows, an id outside ``[0, n_tokens)``, a repeated id."""
    from gguf import GGMLQuantizationType

    path, problems = info["path"], []
    if t.tensor_type != GGMLQuantizationType.I64:
        problems.append(f"{path}: d2t is {t.tensor_type.name}, llama.cpp asserts I64 ({_EAGLE3_CPP})")
    out = info["tensors"].get("output.weight")
    if out is not None and out["shape"][0] != d2t.numel():
        problems.append(f"{path}: d2t has {d2t.numel():,} entries, output.weight {out['shape'][0]:,} rows: "
                        f"llama.cpp asserts they match ({_EAGLE3_CPP})")
    n = info["n_tokens"]
    bad = ((d2t < 0) | (d2t >= n)).nonzero() if n is not None else torch.empty(0, dtype=torch.int64)
    if len(bad):
        i = int(bad[0])
        problems.append(f"{path}: d2t[{i}] = target id {int(d2t[i])}, outside the {n:,} tokens llama.cpp "
                        f"scatters draft logits into ({_EAGLE3_CPP})")
    if torch.unique(d2t).numel() != d2t.numel():
        problems.append(f"{path}: d2t repeats a target id: two draft ids would write one target logit")
    return problems


def features_manifest(features: str | Path) -> tuple[Path, dict]:
    """(path, dict) of a features manifest (``manifest.json`` or its directory, as extract writes
    it: ``aux_layers`` as HF ``hidden_states`` indices, ``num_layers``, ``hidden_size``).

    Raises:
        FileNotFoundError / ValueError: no such file, not a JSON object, another aux layer
            convention than eyas' (``eyas.features.LAYER_CONVENTION``), or ``aux_layers``,
            ``num_layers`` or ``hidden_size`` of the wrong type; each names the file (and the key).
    """
    from eyas.features import LAYER_CONVENTION

    path = Path(features) / "manifest.json" if Path(features).is_dir() else Path(features)
    manifest = read_json(path)
    if manifest.get("aux_layers_convention") != LAYER_CONVENTION or "aux_layers" not in manifest:
        raise ValueError(f"{path}: aux_layers_convention {manifest.get('aux_layers_convention')!r} (eyas reads "
                         f"{LAYER_CONVENTION!r} with aux_layers): not an eyas features manifest")
    for key, kind in (("aux_layers", INT_LIST), ("num_layers", POS_INT), ("hidden_size", POS_INT)):
        v = manifest.get(key)
        if (v is not None or key == "aux_layers") and not has_type(v, kind):
            raise ValueError(f"{path}: {key} is {json.dumps(v)}, expected {kind}")
    return path, manifest


def _drafter_source(drafter_dir: Path) -> tuple[dict, torch.Tensor | None, str, str]:
    """(flat config dict, d2t offsets or None, config path, weights path) of a drafter checkpoint
    directory in the eagle or speculators layout (``transformer_layer_config`` merged over the
    top level, as the converter merges it), the config read by :func:`eyas.export.engine_keys.read_config`."""
    cfg_path, w_path = drafter_dir / "config.json", drafter_dir / "model.safetensors"
    raw = read_config(cfg_path)
    cfg = {**raw, **(raw.get("transformer_layer_config") or {})}
    if not w_path.is_file():
        raise FileNotFoundError(f"{w_path}: no such file (the drafter's weights)")
    with open_safetensors(w_path) as h:
        d2t = h.get_tensor("d2t").to(torch.int64) if "d2t" in h.keys() else None
    return cfg, d2t, str(cfg_path), str(w_path)


def check_against(info: dict, *, drafter_dir: str | Path | None = None, features: str | Path | None = None,
                  vocab_dir: str | Path | None = None, aux_layers: list[int] | None = None,
                  d2t: torch.Tensor | None = None, num_target_layers: int | None = None,
                  target: dict | None = None, target_arch: str | None = None) -> list[str]:
    """Everything in a drafter GGUF (:func:`read_drafter`'s dict) that would make llama.cpp serve
    another function than the drafter was trained as: call it before serving and refuse on any.

    Target layers are compared in llama.cpp's meaning (module docstring): a trained HF index
    ``k < L`` is llama.cpp id ``k``; eyas' id ``L`` is the residual before the final norm
    (eyas.target.layers.capture_aux), which llama.cpp serves as id ``L`` only on the targets
    eyas.export.llamacpp_nextn.PRE_NORM lists.
    d2t is compared through target ids, position by position.
    With ``drafter_dir`` also its weights: ``fc.weight`` and the final norm must be the
    checkpoint's, bit for bit at the GGUF's type (a file converted from another checkpoint), and
    every field that changes the math (eyas.export.gguf_fields.FIELDS, the RoPE frequencies) its config's.

    Args:
        info: :func:`read_drafter`'s dict; its ``problems`` come first in the result.
        drafter_dir: the checkpoint directory the GGUF was converted from (eagle or speculators
            layout): its aux layers (``eyas.target.layers.from_config``: either id form, else the default
            of its ``eyas.num_target_layers``), ``target_hidden_size`` (else ``hidden_size``),
            ``hidden_size``, ``norm_before_residual``, ``norm_before_fc`` and ``d2t``.
        features: a features manifest (``manifest.json`` or its directory): ``aux_layers`` (HF
            ``hidden_states`` indices the drafter was trained on), ``num_layers``, ``hidden_size``.
        vocab_dir: a vocab directory (``vocab.safetensors``, :func:`eyas.vocab.mapping.load_mapping`): its d2t.
        aux_layers: HF ``hidden_states`` indices the drafter was trained on.
        d2t: [draft_vocab] int64 OFFSETS (eyas' convention: target id = i + d2t[i]).
        num_target_layers: the target's decoder-layer count L; else ``target``'s, the manifest's
            or the drafter config's ``eyas.num_target_layers``.
        target: a target summary (``eyas.target.model.summarise_config``): ``num_hidden_layers``,
            ``hidden_size`` (the GGUF's target_hidden_size must equal it), ``vocab_size``,
            ``max_position_embeddings`` and RoPE (eyas.export.gguf_fields.target_field_problems),
            ``architecture`` (as ``target_arch``).
        target_arch: the target's HF class, HF ``model_type`` or llama.cpp architecture (else
            ``target``'s ``architecture``, else the manifest's ``target.class``): a target layer id
            L is refused unless llama.cpp fills it on that architecture with the pre-norm state
            (eyas.export.llamacpp_nextn.id_l_problem; unknown: refused).
    Returns:
        One message per problem, each naming the GGUF file, the key, llama.cpp and the source it
        disagrees with (d2t: how many of N positions agree); empty when it serves as trained.
    Raises:
        FileNotFoundError / ValueError: a given manifest, vocab or drafter file is missing, not a
            JSON object or not safetensors (naming it); a drafter config value of the wrong type
            (:func:`eyas.export.engine_keys.read_config`: an ExportError naming the file and the key).
        eyas.vocab.mapping.VocabError: ``vocab_dir``'s mapping is invalid.
    """
    L = num_target_layers or (target or {}).get("num_hidden_layers")
    src = _Sources(problems=list(info["problems"]), target_arch=target_arch)
    if features is not None:
        src.add_features(info, features)
    if aux_layers is not None:
        src.layers.append(("the given aux_layers", list(aux_layers)))
    if drafter_dir is not None:
        src.add_drafter(info, Path(drafter_dir), L)
    if vocab_dir is not None:
        from eyas.vocab.mapping import load_mapping

        src.d2t.append((str(Path(vocab_dir) / "vocab.safetensors"), load_mapping(vocab_dir)[0].d2t))
    if d2t is not None:
        src.d2t.append(("the given d2t", d2t))
    if target is not None:
        src.sizes.append(("target_hidden_size", "the target's hidden_size", info["target_hidden_size"],
                          target.get("hidden_size")))
        src.problems += target_field_problems(info, target)
        src.target_arch = src.target_arch or target.get("architecture")
    return src.problems + _disagreements(info, src, L or next((n for _, n in src.counts), None), target)


@dataclasses.dataclass
class _Sources:
    """What each source :func:`check_against` was given says the GGUF should hold, gathered before
    any comparison: ``counts`` (source, the target layer count it was made for), ``layers`` (source,
    HF ``hidden_states`` indices), ``d2t`` (source, [draft_vocab] int64 offsets or None for the full
    vocab), ``sizes`` (GGUF key, source, GGUF value, source value); ``problems`` found while reading
    them (after the GGUF's own); ``target_arch`` as known so far."""

    problems: list[str]
    target_arch: str | None
    counts: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    layers: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    d2t: list[tuple[str, torch.Tensor | None]] = dataclasses.field(default_factory=list)
    sizes: list[tuple[str, str, object, object]] = dataclasses.field(default_factory=list)

    def add_features(self, info: dict, features: str | Path) -> None:
        """A features manifest's layer count, aux layers, hidden size and target class.

        Raises:
            FileNotFoundError / ValueError: as :func:`features_manifest`.
        """
        m_path, manifest = features_manifest(features)
        if manifest.get("num_layers") is not None:
            self.counts.append((f"{m_path} num_layers", manifest["num_layers"]))
        self.target_arch = self.target_arch or (manifest.get("target") or {}).get("class")
        self.layers.append((f"{m_path} aux_layers", list(manifest["aux_layers"])))
        self.sizes.append(("target_hidden_size", f"{m_path} hidden_size", info["target_hidden_size"],
                           manifest.get("hidden_size")))

    def add_drafter(self, info: dict, drafter_dir: Path, L: int | None) -> None:
        """A drafter checkpoint directory's layer count, aux layers (for a target of ``L`` layers, else
        of its own ``eyas.num_target_layers`` or a source's count), sizes, norm flags and d2t; its
        weights (:func:`_weight_problems`) and math fields (eyas.export.gguf_fields.field_problems)
        compared with the GGUF's at once.

        Raises:
            FileNotFoundError / ValueError / eyas.export.eagle.ExportError: as :func:`_drafter_source`.
        """
        where, a = info["path"], ARCHITECTURE + "."
        cfg, dd2t, cfg_path, w_path = _drafter_source(drafter_dir)
        Ld = (cfg.get("eyas") or {}).get("num_target_layers")
        if Ld is not None:
            self.counts.append((f"{cfg_path} eyas.num_target_layers", Ld))
        Ld = Ld or L or next((n for _, n in self.counts), None)
        try:
            if Ld is not None:
                self.layers.append((cfg_path, layers.resolve(layers.from_config(cfg, Ld), Ld)))
            elif (ids := converter_target_layers(cfg, None)) is not None:
                self.layers.append((cfg_path, ids))
            else:
                self.problems.append(f"{where}: cannot check {a}target_layers against {cfg_path}: it declares the "
                                     f"default aux layers and the target's layer count is unknown")
        except layers.LayerIdError as e:
            self.problems.append(f"{where}: cannot check {a}target_layers against {cfg_path}: {e}")
        self.sizes += [("target_hidden_size", cfg_path, info["target_hidden_size"],
                        cfg.get("target_hidden_size") or cfg.get("hidden_size")),
                       ("embedding_length", cfg_path, info["hidden_size"], cfg.get("hidden_size")),
                       ("norm_before_residual", cfg_path, info["norm_before_residual"],
                        bool(cfg.get("norm_before_residual", False))),
                       ("norm_before_fc", cfg_path, info["norm_before_fc"], bool(cfg.get("norm_before_fc", False)))]
        self.d2t.append((w_path, dd2t))
        self.problems += _weight_problems(where, w_path, info.get("reader_tensors"))
        self.problems += field_problems(info, cfg, cfg_path)


def _disagreements(info: dict, src: _Sources, L: int | None, target: dict | None) -> list[str]:
    """The GGUF against every gathered source, for a target of ``L`` layers: layer counts, target
    layer ids (beyond L; id L on ``src.target_arch``; other than a source's aux layers), sizes and
    flags, d2t (:func:`_d2t_problems`), and d2t ids past ``target``'s vocab."""
    where, a = info["path"], ARCHITECTURE + "."
    problems = []
    for s, n in src.counts:
        if n != L:
            problems.append(f"{where}: {s} is {n}, the target has {L} layers: the drafter was made for another "
                            f"target, and llama.cpp's layer ids would point at other layers")
    ids = info["target_layers"]
    if L is not None and any(k > L for k in ids):
        problems.append(f"{where}: {a}target_layers {ids} name a layer beyond the target's {L}: llama.cpp aborts "
                        f"({_SPECULATIVE}: target layer id exceeds target n_layer)")
    if (p := id_l_problem(ids, L, src.target_arch)) is not None:
        problems.append(f"{where}: {a}target_layers {ids}: {p}")
    for s, hf in src.layers:
        if list(hf) != ids:
            problems.append(f"{where}: {a}target_layers {ids} != {s} {hf}: llama.cpp would feed the drafter the "
                            f"inputs of target layers {ids} ({_SPECULATIVE}), not the HF hidden_states {hf} it was "
                            f"trained on")
    for key, s, got, want in src.sizes:
        if want is not None and got != want:
            problems.append(f"{where}: {a}{key} {got!r} != {s} {want!r}: llama.cpp would serve another "
                            f"drafter function than the one trained ({_EAGLE3_CPP})")
    for s, offsets in src.d2t:
        problems += _d2t_problems(info, s, offsets)
    V = (target or {}).get("vocab_size")
    if V is not None and info["d2t"] is not None and int(info["d2t"].max()) >= V:
        problems.append(f"{where}: d2t maps to target id {int(info['d2t'].max())}, outside the target's "
                        f"vocab of {V:,}")
    return problems


class ServeMismatchError(ValueError):
    """A drafter GGUF would be served as another function than the drafter trained
    (:func:`check_against`); the message lists every problem."""


def require_served_as_trained(gguf_file: str | Path, drafter_dir: str | Path, num_target_layers: int,
                              target_arch: str | None = None) -> dict:
    """:func:`read_drafter` of ``gguf_file`` checked against the checkpoint directory it was
    converted from (:func:`check_against`: every field that changes the math, target layers, d2t,
    weights), for a target of ``num_target_layers`` layers of architecture ``target_arch`` (an HF
    class; needed only for a target layer id L), and its bytes against the digest :func:`convert`
    recorded (eyas.export.gguf_fields.digest_problem): what the export and the eval call before
    llama.cpp serves it.

    Returns:
        :func:`read_drafter`'s dict.
    Raises:
        ServeMismatchError: one or more problems (all listed, one per line).
        GGUFReadError / FileNotFoundError: as :func:`read_drafter`.
    """
    info = read_drafter(gguf_file)
    problems = check_against(info, drafter_dir=drafter_dir, num_target_layers=num_target_layers,
                             target_arch=target_arch)
    if (p := digest_problem(gguf_file)) is not None:
        problems.append(p)
    if problems:
        raise ServeMismatchError(f"{gguf_file}: llama.cpp would not serve the drafter of {drafter_dir} as trained:\n"
                                 + "\n".join(f"- {x}" for x in problems))
    return info


_SAME_WEIGHTS = (("fc.weight", "fc.weight"), ("output_norm.weight", "norm.weight"))
"""(GGUF tensor, eyas tensor) pairs the converter copies unchanged (``conversion/llama.py`` maps
names only): a GGUF converted from a checkpoint holds exactly its values, at the GGUF's type."""


def _weight_problems(where: str, w_path: str, tensors: dict | None = None) -> list[str]:
    """The GGUF's :data:`_SAME_WEIGHTS` against the checkpoint's, compared bit for bit at the GGUF's
    type (F32, F16 or BF16; a quantised type is not compared): a file converted from another
    checkpoint (another drafter's GGUF with the same vocab and layers, or one left from before
    the drafter was retrained) has the right shape and metadata and other weights. ``tensors``:
    :func:`read_drafter`'s ``reader_tensors`` of ``where``; None reads the file again."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader

    as_torch = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                GGMLQuantizationType.BF16: torch.bfloat16}
    if tensors is None:
        tensors = {t.name: t for t in GGUFReader(where).tensors}
    out = []
    with open_safetensors(w_path) as h:
        for g_name, e_name in _SAME_WEIGHTS:
            t = tensors.get(g_name)
            if t is None or e_name not in h.keys() or t.tensor_type not in as_torch:
                continue
            want = h.get_tensor(e_name).to(as_torch[t.tensor_type])
            raw = np.asarray(t.data).reshape(-1)
            got = (torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
                   if t.tensor_type == GGMLQuantizationType.BF16 else torch.from_numpy(raw.copy()))
            if got.numel() != want.numel() or not torch.equal(got, want.reshape(-1)):
                out.append(f"{where}: {g_name} is not {w_path}'s {e_name} (at the GGUF's {t.tensor_type.name}): the "
                           f"file was converted from another checkpoint (another drafter's GGUF, or one from before "
                           f"this drafter was retrained); convert it again")
    return out


def _d2t_problems(info: dict, src: str, offsets: torch.Tensor | None) -> list[str]:
    """The GGUF's absolute d2t against ``src``'s offsets (``None``: ``src`` has no d2t, the full vocab)."""
    where, g = info["path"], info["d2t"]
    what = f"d2t (llama.cpp's draft -> target id map, {_EAGLE3_CPP})"
    if offsets is None:
        if g is not None and not torch.equal(g, torch.arange(g.numel())):
            return [f"{where}: {what} maps {g.numel():,} draft ids, {src} has no d2t (the full vocab)"]
        return []
    want = torch.arange(offsets.numel(), dtype=torch.int64) + offsets.to(torch.int64).reshape(-1)
    if g is None:
        if torch.equal(want, torch.arange(want.numel())) and want.numel() == info["n_tokens"]:
            return []
        return [f"{where}: no d2t tensor: llama.cpp serves draft id i as target id i, {src} maps "
                f"{want.numel():,} draft ids to other target ids"]
    if g.numel() != want.numel():
        return [f"{where}: {what} has {g.numel():,} entries, {src} has {want.numel():,} (draft_vocab_size)"]
    agree = int((g == want).sum())
    if agree == want.numel():
        return []
    return [f"{where}: {what} agrees with {src} at {agree:,} of {want.numel():,} draft positions: llama.cpp "
            f"would put the drafter's logits on other target tokens"]
