"""The export manifest: exactly the served keys and shapes, tie_word_embeddings false, tensors equal
to the trained ones bit for bit (checked by parsing the safetensors file by hand), and loud errors
for a missing or unknown key."""

import hashlib
import json
import struct

import pytest
import torch

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export.eagle import SERVED_KEYS, ExportError, check_served_tensors, save_drafter
from eyas.export.load import load_drafter

V, VD = 128, 16


def make_drafter(seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=V, draft_vocab_size=VD, target_hidden_size=48, num_target_layers=8)
    d = Eagle3Drafter(c)
    for p in d.parameters():  # "train" it: norms away from 1, everything off its init
        p.data.add_(torch.randn_like(p) * 0.1)
    ids = torch.randperm(V)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab(ids - torch.arange(VD), t2d)
    d.set_embedding(torch.randn(V, 32))
    return d


def raw_safetensors(path) -> dict:
    """Parse a safetensors file WITHOUT the safetensors library: 8-byte little-endian header length,
    a JSON header {name: {dtype, shape, data_offsets}}, then the data. Returns name -> (dtype,
    shape, sha256 of the raw bytes)."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    data = blob[8 + n:]
    return {k: (v["dtype"], tuple(v["shape"]),
                hashlib.sha256(data[v["data_offsets"][0]:v["data_offsets"][1]]).hexdigest())
            for k, v in header.items()}


def tensor_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def test_manifest_exact_keys_shapes_and_bits(tmp_path):
    d = make_drafter()
    trained = {k: v.clone() for k, v in d.state_dict().items()}
    save_drafter(d, tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["config.json", "model.safetensors"]
    raw = raw_safetensors(tmp_path / "out" / "model.safetensors")
    # exactly the served keys: no embedding, nothing extra
    assert set(raw) == set(SERVED_KEYS)
    assert "embed_tokens.weight" not in raw
    H, I, TH = 32, 64, 48
    expect = {
        "fc.weight": ("F32", (H, 3 * TH)),
        "midlayer.input_layernorm.weight": ("F32", (H,)),
        "midlayer.hidden_norm.weight": ("F32", (H,)),
        "midlayer.self_attn.q_proj.weight": ("F32", (4 * 8, 2 * H)),
        "midlayer.self_attn.k_proj.weight": ("F32", (2 * 8, 2 * H)),
        "midlayer.self_attn.v_proj.weight": ("F32", (2 * 8, 2 * H)),
        "midlayer.self_attn.o_proj.weight": ("F32", (H, 4 * 8)),
        "midlayer.post_attention_layernorm.weight": ("F32", (H,)),
        "midlayer.mlp.gate_proj.weight": ("F32", (I, H)),
        "midlayer.mlp.up_proj.weight": ("F32", (I, H)),
        "midlayer.mlp.down_proj.weight": ("F32", (H, I)),
        "norm.weight": ("F32", (H,)),
        "lm_head.weight": ("F32", (VD, H)),
        "d2t": ("I64", (VD,)),
        "t2d": ("BOOL", (V,)),
    }
    for k, (dtype, shape) in expect.items():
        assert raw[k][:2] == (dtype, shape), k
        assert raw[k][2] == tensor_sha(trained[k]), f"{k} differs from the trained tensor"

    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["tie_word_embeddings"] is False
    assert cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == V and cfg["draft_vocab_size"] == VD
    assert cfg["target_hidden_size"] == 48  # differs from hidden_size 32, so it is written
    # and load_drafter gives back the same tensors
    back = load_drafter(tmp_path / "out")
    for k, v in back.state_dict_for_export().items():
        assert tensor_sha(v) == tensor_sha(trained[k]), k


def test_target_hidden_size_omitted_when_equal(tmp_path):
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=V, draft_vocab_size=V, target_hidden_size=32, num_target_layers=8)
    d = Eagle3Drafter(c)
    d.set_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    save_drafter(d, tmp_path / "o")
    assert "target_hidden_size" not in json.loads((tmp_path / "o" / "config.json").read_text())


@pytest.mark.parametrize("drop", ["lm_head.weight", "midlayer.hidden_norm.weight", "t2d"])
def test_missing_key_is_an_error(tmp_path, drop, monkeypatch):
    d = make_drafter()
    full = d.state_dict_for_export()
    monkeypatch.setattr(d, "state_dict_for_export", lambda: {k: v for k, v in full.items() if k != drop})
    with pytest.raises(ExportError, match=rf"missing tensor\(s\) \['{drop}'\]"):
        save_drafter(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("extra", ["embed_tokens.weight", "layers.0.mlp.up_proj.weight", "fc.bias"])
def test_unknown_key_is_an_error(extra):
    d = make_drafter()
    t = dict(d.state_dict_for_export(), **{extra: torch.zeros(3)})
    with pytest.raises(ExportError, match=rf"unknown tensor\(s\) \['{extra}'\].*silently skips"):
        check_served_tensors(t, d.config, "ckpt")


def test_unknown_key_in_a_file_refuses_to_load(tmp_path):
    from eyas.io import save_safetensors
    d = make_drafter()
    save_drafter(d, tmp_path / "out")
    t = dict(d.state_dict_for_export(), **{"midlayer.extra_norm.weight": torch.ones(32)})
    save_safetensors(t, tmp_path / "out" / "model.safetensors")
    with pytest.raises(ExportError, match="midlayer.extra_norm.weight"):
        load_drafter(tmp_path / "out")


def test_wrong_shape_and_dtype_are_errors():
    d = make_drafter()
    t = dict(d.state_dict_for_export())
    t["lm_head.weight"] = torch.zeros(V, 32)  # full vocab rows under a draft_vocab_size 16 config
    with pytest.raises(ExportError, match=r"lm_head.weight has shape \(128, 32\), config implies \(16, 32\)"):
        check_served_tensors(t, d.config, "ckpt")
    t = dict(d.state_dict_for_export())
    t["d2t"] = t["d2t"].to(torch.int32)
    with pytest.raises(ExportError, match="int64"):
        check_served_tensors(t, d.config, "ckpt")


def test_norm_before_residual_true_is_refused(tmp_path):
    d = make_drafter()
    save_drafter(d, tmp_path / "out")
    p = tmp_path / "out" / "config.json"
    p.write_text(json.dumps(dict(json.loads(p.read_text()), norm_before_residual=True)))
    with pytest.raises(ExportError, match="norm_before_residual: true.*UN-normed residual"):
        load_drafter(tmp_path / "out")
