"""Every GGUF field that changes an EAGLE-3 drafter's math in llama.cpp is checked against the
checkpoint and the target (eyas.export.gguf_fields), and an exported file's bytes against its digest.

The fast tests write GGUFs with the gguf package's GGUFWriter holding the keys llama.cpp's
converter writes for a small llama3-scaled drafter (``conversion/base.py`` set_gguf_parameters,
``conversion/llama.py``: the rope_freqs tensor, computed here by the converter's own formula), then
change one field at a time. tests/export/test_gguf.py runs the real converter on a llama3-scaled drafter
and edits its output (:func:`rewrite_gguf`)."""

import math

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export import gguf, gguf_fields
from eyas.export.eagle import save_drafter
from eyas.export.inspector import inspect_gguf
from eyas.io import load_safetensors

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
HD = 64  # head_dim: 32 frequencies, across all three llama3 bands (original context 64)


def _config(**kw) -> DrafterConfig:
    base = dict(hidden_size=128, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=HD,
                vocab_size=16, draft_vocab_size=4, target_hidden_size=128, num_target_layers=8, rms_norm_eps=1e-6,
                rope_theta=500000.0, rope_scaling=dict(LLAMA3), max_position_embeddings=512)
    return DrafterConfig(**{**base, **kw})


def _converter_rope_freqs(theta, dim, s) -> list[float]:
    """conversion/llama.py LlamaModel.generate_extra_tensors, as written there."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_w, high_w = s["original_max_position_embeddings"] / s["low_freq_factor"], \
        s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        w = 2 * math.pi / f
        if w < high_w:
            out.append(1.0)
        elif w > low_w:
            out.append(s["factor"])
        else:
            sm = (s["original_max_position_embeddings"] / w - s["low_freq_factor"]) / \
                (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - sm) / s["factor"] + sm))
    return out


def _keys(c: DrafterConfig) -> dict:
    """What the converter writes for ``c`` (eagle3.* keys without the prefix)."""
    return {"embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
            "rope.dimension_count": c.head_dim, "attention.layer_norm_rms_epsilon": c.rms_norm_eps,
            "context_length": c.max_position_embeddings, "vocab_size": c.vocab_size, "rope.freq_base": c.rope_theta}


def _checkpoint(root, c: DrafterConfig):
    """The drafter checkpoint a GGUF is checked against: ``c``'s config, draft ids [1, 3, 5, 7]."""
    if not (root / "ckpt").is_dir():
        torch.manual_seed(0)
        d = Eagle3Drafter(c)
        ids = torch.tensor([1, 3, 5, 7])
        t2d = torch.zeros(16, dtype=torch.bool)
        t2d[ids] = True
        d.set_vocab(ids - torch.arange(4), t2d)
        save_drafter(d, root / "ckpt")
    return root / "ckpt"


def _write(path, keys: dict, rope_freqs=None):
    """A GGUF with ``keys`` and the checkpoint's tensors as the converter names them (fc, the final
    norm, the lm_head, d2t as absolute target ids)."""
    w_ckpt = load_safetensors(_checkpoint(path.parent, _config()) / "model.safetensors")
    w = GGUFWriter(str(path), "eagle3")
    w.add_array("eagle3.target_layers", [2, 4, 5])
    w.add_uint32("eagle3.target_hidden_size", 128)
    w.add_uint32("eagle3.block_count", 1)
    for k, v in keys.items():
        if isinstance(v, bool):
            w.add_bool(f"eagle3.{k}", v)
        elif isinstance(v, str):
            w.add_string(f"eagle3.{k}", v)
        elif isinstance(v, float):
            w.add_float32(f"eagle3.{k}", v)
        else:
            w.add_uint32(f"eagle3.{k}", v)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)])
    w.add_tensor("fc.weight", w_ckpt["fc.weight"].numpy())
    w.add_tensor("output_norm.weight", w_ckpt["norm.weight"].numpy())
    w.add_tensor("output.weight", w_ckpt["lm_head.weight"].numpy())
    w.add_tensor("d2t", (w_ckpt["d2t"] + torch.arange(4)).numpy())
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _problems(path, c: DrafterConfig, target: dict | None = None) -> list[str]:
    """What check_against finds in ``path`` against the checkpoint of ``c`` (and ``target``), with
    the checkpoint's config.json named ``config.json`` in the messages."""
    ckpt = _checkpoint(path.parent, c)
    out = gguf.check_against(gguf.read_drafter(path), drafter_dir=ckpt, num_target_layers=8, target=target)
    return [p.replace(str(ckpt / "config.json"), "config.json") for p in out]


def test_the_fields_the_converter_writes_pass_and_each_changed_field_is_named(tmp_path):
    c = _config()
    keys = _keys(c)
    ff = _converter_rope_freqs(c.rope_theta, HD, LLAMA3)
    assert 1.0 in ff and 8.0 in ff and any(1 < f < 8 for f in ff)  # all three bands: a real test of the formula
    target = {"hidden_size": 128, "num_attention_heads": 2, "rope_theta": c.rope_theta, "rope_scaling": dict(LLAMA3),
              "max_position_embeddings": 512, "num_hidden_layers": 8, "vocab_size": 16}
    assert _problems(_write(tmp_path / "ok.gguf", keys, ff), c, target) == []  # the control
    cases = {  # file name: (keys changed, rope_freqs, the message's start after the path)
        "theta": ({"rope.freq_base": 10000.0}, ff, "RoPE rope.freq_base 10000"),
        "dropped": ({}, None, "RoPE rope.freq_base 500000, rope.scaling.type linear, rope.scaling.factor 0, "
                              "rope_freqs.weight absent: llama.cpp's frequencies differ"),
        "linear": ({"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}, None, "RoPE rope.freq_base 500000, "
                   "rope.scaling.type linear, rope.scaling.factor 8"),
        "yarn": ({"rope.scaling.type": "yarn", "rope.scaling.factor": 8.0}, ff,
                 "RoPE rope.freq_base 500000, rope.scaling.type yarn"),
        "eps": ({"attention.layer_norm_rms_epsilon": 1e-5}, ff, "eagle3.attention.layer_norm_rms_epsilon 1e-05 != "
                "config.json rms_norm_eps 1e-06"),
        "heads": ({"attention.head_count": 4}, ff, "eagle3.attention.head_count 4 != config.json "
                  "num_attention_heads 2"),
        "kv": ({"attention.head_count_kv": 2}, ff, "eagle3.attention.head_count_kv 2 != config.json "
               "num_key_value_heads 1"),
        "head_dim": ({"attention.key_length": 32}, ff, "eagle3.attention.key_length 32 != config.json head_dim 64"),
        "n_rot": ({"rope.dimension_count": 32}, ff, "eagle3.rope.dimension_count 32 != config.json head_dim 64"),
        "ctx": ({"context_length": 4096}, ff, "eagle3.context_length 4096 != config.json max_position_embeddings 512"),
        "ffn": ({"feed_forward_length": 64}, ff, "eagle3.feed_forward_length 64 != config.json intermediate_size 32"),
        "causal": ({"attention.causal": False}, ff, "eagle3.attention.causal False != eyas' drafter True"),
        "attn_factor": ({"rope.scaling.attn_factor": 2.0}, ff, "eagle3.rope.scaling.attn_factor 2.0 != eyas' "
                        "drafter 1.0"),
    }
    for name, (change, freqs, msg) in cases.items():
        path = _write(tmp_path / f"{name}.gguf", {**keys, **change}, freqs)
        p = _problems(path, c)
        assert len(p) >= 1 and p[0].startswith(f"{path}: {msg}"), (name, p)
    # the measured cases: llama3 scaling dropped is up to 8x off (the factor), theta 10000 far more
    p = _problems(tmp_path / "dropped.gguf", c)
    assert "up to 8x at dimension" in p[0], p
    # a missing key takes llama.cpp's default: kv heads = heads (2, not 1), key/value length and n_rot = hidden / heads
    bare = {k: v for k, v in keys.items() if k not in ("attention.head_count_kv", "attention.key_length",
                                                        "attention.value_length", "rope.dimension_count")}
    path = _write(tmp_path / "bare.gguf", bare, ff)
    p = _problems(path, c)
    assert len(p) == 1 and p[0].startswith(f"{path}: eagle3.attention.head_count_kv 2 != config.json "
                                           f"num_key_value_heads 1"), p


def test_against_the_target_context_and_rope(tmp_path):
    c = _config()
    path = _write(tmp_path / "ok.gguf", _keys(c), _converter_rope_freqs(c.rope_theta, HD, LLAMA3))
    target = {"hidden_size": 128, "num_attention_heads": 2, "rope_theta": c.rope_theta, "max_position_embeddings": 8192,
              "num_hidden_layers": 8, "vocab_size": 16}
    p = gguf.check_against(gguf.read_drafter(path), target=target)
    assert len(p) == 2, p
    assert p[0] == f"{path}: eagle3.context_length 512 != the target's max_position_embeddings 8192 " \
                   f"(src/llama-model.cpp load_hparams)"
    assert "differ from the target's (theta 500000 (no scaling))" in p[1], p
    # inspect says it, as errors
    r = inspect_gguf(path, target=target)
    assert sum("eagle3.context_length 512" in e or "RoPE" in e for e in r["errors"]) == 2, r["errors"]


def test_a_changed_byte_is_refused_before_serving_by_the_digest_recorded_at_export(tmp_path):
    c = _config()
    path = _write(tmp_path / "d.gguf", _keys(c), _converter_rope_freqs(c.rope_theta, HD, LLAMA3))
    ckpt = _checkpoint(tmp_path, c)
    with pytest.raises(gguf.ServeMismatchError, match="d.gguf: no digest recorded at export"):
        gguf.require_served_as_trained(path, ckpt, 8)
    hexd = gguf_fields.write_digest(path)  # what convert does
    assert (tmp_path / "d.gguf.sha256").read_text() == f"{hexd}  d.gguf\n"  # sha256sum's format
    gguf.require_served_as_trained(path, ckpt, 8)  # the control: as exported, it serves
    out = next(t for t in GGUFReader(str(path)).tensors if t.name == "output.weight")
    data = bytearray(path.read_bytes())
    at = int(out.data_offset) + 64
    data[at:at + 64] = bytes(64)  # a zeroed block inside the lm_head's data: no field or weight check reads it
    path.write_bytes(bytes(data))
    assert gguf.check_against(gguf.read_drafter(path), drafter_dir=ckpt, num_target_layers=8) == []
    with pytest.raises(gguf.ServeMismatchError, match="d.gguf: its bytes changed after export"):
        gguf.require_served_as_trained(path, ckpt, 8)


def rewrite_gguf(src, dst, set_keys: dict | None = None, drop_tensors=(), zero=None):
    """A copy of the GGUF ``src`` at ``dst`` with eagle3.* ``set_keys`` (float32 values),
    ``drop_tensors`` left out and ``zero`` (a tensor name) zeroed in its first 64 elements."""
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), "eagle3")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        if name in (set_keys or {}):
            w.add_key_value(name, set_keys[name], vtype)
            continue
        val = f.contents()
        w.add_key_value(name, val, vtype, f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        data = np.array(t.data)
        if t.name == zero:
            data.reshape(-1)[:64] = 0
        w.add_tensor(t.name, data, raw_shape=list(reversed([int(x) for x in t.shape])) if data.dtype == np.uint8
                     else None, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
