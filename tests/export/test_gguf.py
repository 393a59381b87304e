"""Reading a drafter GGUF back as llama.cpp loads it, and refusing one that llama.cpp would serve
differently from how the drafter was trained.

The converter tests run llama.cpp's own converter (installed by scripts/build_llama_server.sh) on
drafters sized for the embedded SmolLM2-135M target (30 layers, hidden 576, vocab 49,152), and
read the files back with the gguf package's GGUFReader directly for the expected values. The
other tests write small GGUFs with the gguf package's GGUFWriter, or use tiny drafters."""

import dataclasses
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from safetensors.torch import save_file

from eyas.cli import main
from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export import gguf, gguf_fields
from eyas.export.eagle import save_drafter
from eyas.export.inspector import inspect_checkpoint, inspect_gguf, render_gguf
from eyas.io import load_safetensors
from eyas.vocab.mapping import VocabMapping, save_mapping
from tests.export.test_gguf_fields import LLAMA3, rewrite_gguf

L, H, V, VD = 30, 576, 49152, 256
DEFAULT = [2, 15, 27]  # [2, L//2, L-3] for L = 30
SHIFTED = [3, 16, 28]


def _manifest(path, aux_layers, num_layers=L, hidden_size=H):
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps({
        "aux_layers_convention": "hf_hidden_states_index", "aux_layers": aux_layers,
        "num_layers": num_layers, "hidden_size": hidden_size, "vocab_size": V}))
    return path / "manifest.json"


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _target_ids(seed=0) -> torch.Tensor:
    """VD ascending target ids, all below 40,000 (so ids above it can replace the last ones and
    keep the order)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(40000, generator=g)[:VD].sort().values


def _set_ids(d: Eagle3Drafter, ids: torch.Tensor):
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab(ids - torch.arange(VD), t2d)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Drafter directories and their GGUFs converted by llama.cpp's converter: ``default``
    (default aux layers), ``shifted`` (explicit ids SHIFTED in both forms), ``nested`` (ids only in
    the SGLang form, which the converter does not read), ``scrambled`` (the last 4 draft ids mapped
    to other target ids), ``llama3`` (the default drafter with a llama3-scaled RoPE). Returns name ->
    (drafter dir, gguf path), plus ``target`` (the target dir)."""
    if not gguf.CONVERTER.is_file():
        pytest.skip(f"llama.cpp's converter is not installed at {gguf.CONVERTER} (scripts/build_llama_server.sh)")
    from transformers import LlamaForCausalLM

    from eyas.target.model import load_tokenizer_and_config

    tmp = tmp_path_factory.mktemp("gguf")
    tokenizer, cfg = load_tokenizer_and_config("embedded")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (L, H, V)
    with torch.device("meta"):  # the converter reads only the target's config.json and tokenizer
        target_model = LlamaForCausalLM(cfg)
    target = gguf.write_target_dir(target_model, tokenizer, tmp / "target")

    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, num_target_layers=L)
    d = Eagle3Drafter(c)
    for p in d.parameters():  # off its init: norms away from 1
        p.data.add_(torch.randn_like(p) * 0.1)
    _set_ids(d, _target_ids())
    dirs = {"default": tmp / "default", "shifted": tmp / "shifted", "nested": tmp / "nested",
            "scrambled": tmp / "scrambled", "llama3": tmp / "llama3"}
    save_drafter(d, dirs["default"])
    d3 = Eagle3Drafter(dataclasses.replace(c, rope_theta=500000.0, rope_scaling=dict(LLAMA3),
                                           max_position_embeddings=512))
    d3.load_state_dict(d.state_dict())
    save_drafter(d3, dirs["llama3"])
    shutil.copytree(dirs["default"], dirs["shifted"])
    _edit_config(dirs["shifted"], eagle_aux_hidden_state_layer_ids=SHIFTED,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": [k - 1 for k in SHIFTED]})
    shutil.copytree(dirs["default"], dirs["nested"])
    _edit_config(dirs["nested"], eagle_config={"eagle_aux_hidden_state_layer_ids": [k - 1 for k in SHIFTED]})
    ids = _target_ids()
    ids[-4:] = torch.tensor([40001, 40002, 40003, 40004])
    _set_ids(d, ids)
    save_drafter(d, dirs["scrambled"])

    def run(name):
        return name, (dirs[name], gguf.convert(dirs[name], tmp / f"{name}.gguf", "f32", target))

    with ThreadPoolExecutor(len(dirs)) as pool:  # one converter process each
        out = dict(pool.map(run, dirs))
    out["target"] = target
    return out


def _gguf_tensors(path, names) -> dict[str, np.ndarray]:
    """The named tensors' data as the gguf package reads them (torch order)."""
    return {t.name: np.asarray(t.data) for t in GGUFReader(str(path)).tensors if t.name in names}


@pytest.mark.slow  # the tokenizer of the embedded target and four converter runs
def test_read_back_equals_what_the_converter_was_given(converted, tmp_path):
    d_dir, path = converted["default"]
    info = gguf.read_drafter(path)
    w = load_safetensors(d_dir / "model.safetensors")
    assert info["architecture"] == "eagle3" and info["problems"] == []
    assert info["target_layers"] == DEFAULT  # the converter's default for L = 30, no ids in the config
    assert info["target_hidden_size"] == H and info["hidden_size"] == H and info["intermediate_size"] == 64
    assert (info["num_attention_heads"], info["num_key_value_heads"], info["head_dim"]) == (9, 3, 64)
    assert info["norm_before_residual"] is False and info["norm_before_fc"] is False
    assert info["num_hidden_layers"] == 1 and info["vocab_size"] == V and info["n_tokens"] == V
    assert info["draft_vocab_size"] == VD and info["d2t"].dtype == torch.int64
    assert torch.equal(info["d2t"], w["d2t"] + torch.arange(VD))  # absolute ids
    assert torch.equal(info["d2t"], _target_ids())
    assert info["own_lm_head"] and not info["own_embedding"]  # the target's embedding, as eyas exports it
    assert info["tensors"]["fc.weight"] == {"shape": [H, 3 * H], "type": "F32"}
    names = {"fc.weight": "fc.weight", "output.weight": "lm_head.weight",
             "blk.0.attn_norm_2.weight": "midlayer.hidden_norm.weight", "output_norm.weight": "norm.weight"}
    data = _gguf_tensors(path, names)
    assert set(data) == set(names)
    for gguf_name, eyas_name in names.items():
        assert np.array_equal(data[gguf_name], w[eyas_name].numpy()), gguf_name

    # the pipeline context it was made from: nothing to refuse
    vocab = tmp_path / "vocab"
    save_mapping(vocab, VocabMapping(w["d2t"], w["t2d"]), torch.zeros(V, dtype=torch.int64), {})
    manifest = _manifest(tmp_path / "features", DEFAULT)
    target = {"num_hidden_layers": L, "hidden_size": H, "vocab_size": V}
    assert gguf.check_against(info, drafter_dir=d_dir, features=manifest, vocab_dir=vocab, target=target) == []


@pytest.mark.slow  # the tokenizer of the embedded target and four converter runs
def test_shifted_layers_are_carried_and_refused_against_the_training_layers(converted, tmp_path, capsys):
    d_dir, path = converted["shifted"]
    info = gguf.read_drafter(path)
    assert info["target_layers"] == SHIFTED  # explicit top-level ids carried verbatim
    assert gguf.check_against(info, drafter_dir=d_dir) == []  # as its own config says
    manifest = _manifest(tmp_path / "features", DEFAULT)
    default_dir = converted["default"][0]
    for problems, src in ((gguf.check_against(info, features=manifest), str(manifest)),
                          (gguf.check_against(info, drafter_dir=default_dir), str(default_dir / "config.json")),
                          (gguf.check_against(info, aux_layers=DEFAULT), "the given aux_layers")):
        assert len(problems) == 1, problems
        p = problems[0]
        assert p.startswith(f"{path}: eagle3.target_layers {SHIFTED} != {src}") and "llama.cpp" in p, p
        assert str(DEFAULT) in p
    assert main(["inspect", str(path), "--features", str(manifest)]) == 1
    out = capsys.readouterr().out
    assert f"ERROR   {path}: eagle3.target_layers {SHIFTED}" in out
    assert "3: the input of target layer 3 = output of layer 2 = HF hidden_states[3]" in out


@pytest.mark.slow  # the tokenizer of the embedded target and four converter runs
def test_ids_only_in_the_sglang_form_are_lost_by_the_converter_and_refused(converted):
    d_dir, path = converted["nested"]
    info = gguf.read_drafter(path)
    assert info["target_layers"] == DEFAULT  # the converter reads the top-level key only
    problems = gguf.check_against(info, drafter_dir=d_dir)
    assert len(problems) == 1 and f"eagle3.target_layers {DEFAULT} != {d_dir / 'config.json'} {SHIFTED}" \
        in problems[0], problems
    # inspect of the checkpoint says so before converting it
    r = inspect_checkpoint(d_dir)
    assert r["engines"]["llamacpp"]["target_layers"] == DEFAULT
    assert any(w.startswith(f"llama.cpp: the converter would write eagle3.target_layers {DEFAULT}")
               and str(SHIFTED) in w for w in r["warnings"]), r["warnings"]


@pytest.mark.slow  # the tokenizer of the embedded target and four converter runs
def test_scrambled_d2t_is_refused_with_the_count_that_agrees(converted, tmp_path):
    d_dir, path = converted["scrambled"]
    info = gguf.read_drafter(path)
    assert info["d2t"][-4:].tolist() == [40001, 40002, 40003, 40004]
    assert gguf.check_against(info, drafter_dir=d_dir) == []  # its own mapping
    w = load_safetensors(converted["default"][0] / "model.safetensors")
    vocab = tmp_path / "vocab"
    save_mapping(vocab, VocabMapping(w["d2t"], w["t2d"]), torch.zeros(V, dtype=torch.int64), {})
    for problems, src in (
            (gguf.check_against(info, drafter_dir=converted["default"][0]),
             converted["default"][0] / "model.safetensors"),
            (gguf.check_against(info, vocab_dir=vocab), vocab / "vocab.safetensors"),
            (gguf.check_against(info, d2t=w["d2t"]), "the given d2t")):
        assert problems == [f"{path}: d2t (llama.cpp's draft -> target id map, src/models/eagle3.cpp) agrees with "
                            f"{src} at 252 of 256 draft positions: llama.cpp would put the drafter's logits on "
                            f"other target tokens"], problems
    r = inspect_gguf(path, vocab_dir=vocab)
    assert len(r["errors"]) == 1 and "252 of 256" in render_gguf(r)


# --- fast: hand-written GGUFs and tiny drafters ----------------------------------------------

def _write_gguf(path, arch="eagle3", target_layers=(2, 15, 27), d2t=(5, 9, 11, 20), n_tokens=32, blocks=1):
    """A minimal GGUF with the keys and tensors read_drafter reads (hidden 8, target hidden 4)."""
    w = GGUFWriter(str(path), arch)
    if target_layers is not None:
        w.add_array(f"{arch}.target_layers", list(target_layers))
    w.add_uint32(f"{arch}.target_hidden_size", 4)
    w.add_uint32(f"{arch}.block_count", blocks)
    w.add_uint32(f"{arch}.embedding_length", 8)
    w.add_uint32(f"{arch}.attention.head_count", 2)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_tokens)])
    w.add_tensor("fc.weight", np.zeros((8, 4 * len(target_layers or ())), dtype=np.float32))
    w.add_tensor("output.weight", np.zeros((len(d2t), 8), dtype=np.float32))
    w.add_tensor("d2t", np.asarray(d2t, dtype=np.int64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_file_that_is_not_an_eagle3_gguf_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.gguf"):
        gguf.read_drafter(tmp_path / "nothere.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(gguf.GGUFReadError, match="junk.gguf: not a GGUF file"):
        gguf.read_drafter(tmp_path / "junk.gguf")
    good = _write_gguf(tmp_path / "good.gguf")
    assert gguf.read_drafter(good)["target_layers"] == [2, 15, 27]  # the control: the same writer, readable
    size = good.stat().st_size
    for n in (100, size // 2, size - 1):  # cut in the header, in the tensor data, at the last byte
        (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:n])
        with pytest.raises(gguf.GGUFReadError, match=f"cut.gguf: a GGUF file cut short \\(truncated: {n:,} bytes"):
            gguf.read_drafter(tmp_path / "cut.gguf")
    with pytest.raises(gguf.GGUFReadError, match="general.architecture is 'llama', not 'eagle3'"):
        gguf.read_drafter(_write_gguf(tmp_path / "target.gguf", arch="llama"))
    with pytest.raises(gguf.GGUFReadError, match="no eagle3.target_layers"):
        gguf.read_drafter(_write_gguf(tmp_path / "nolayers.gguf", target_layers=None))
    assert main(["inspect", str(tmp_path / "target.gguf")]) == 2
    assert main(["inspect", str(good), "--num-target-layers", "30"]) == 0


def test_what_llama_cpp_would_refuse_or_misserve_in_the_file_itself(tmp_path):
    info = gguf.read_drafter(_write_gguf(tmp_path / "ok.gguf"))
    assert info["problems"] == [] and info["d2t"].tolist() == [5, 9, 11, 20] and info["n_tokens"] == 32
    cases = {
        "layers.gguf": ({"target_layers": (2, 15, 27, 29)}, "holds 4 ids: llama.cpp requires exactly 3"),
        "blocks.gguf": ({"blocks": 2}, "block_count 2"),
        "range.gguf": ({"d2t": (5, 9, 11, 32)}, "d2t[3] = target id 32, outside the 32 tokens"),
        "dup.gguf": ({"d2t": (5, 9, 9, 20)}, "d2t repeats a target id"),
    }
    for name, (kw, msg) in cases.items():
        problems = gguf.read_drafter(_write_gguf(tmp_path / name, **kw))["problems"]
        assert any(msg in p and p.startswith(str(tmp_path / name)) for p in problems), (name, problems)


def test_target_layers_are_checked_in_llama_cpps_meaning(tmp_path):
    info = gguf.read_drafter(_write_gguf(tmp_path / "a.gguf", target_layers=(2, 15, 30)))
    # id L = 30: the residual before the final norm in eyas (eyas.target.layers.capture_aux); llama.cpp fills it so
    # only on a target whose graph sets t_h_nextn before the final norm (gpt-oss: src/models/openai-moe.cpp)
    assert gguf.check_against(info, aux_layers=[2, 15, 30], num_target_layers=30, target_arch="gpt-oss") == []
    p = gguf.check_against(info, aux_layers=[2, 15, 29], num_target_layers=30, target_arch="gpt-oss")  # a control
    assert len(p) == 1 and "target_layers [2, 15, 30] != the given aux_layers [2, 15, 29]" in p[0], p
    assert gguf.check_against(info, aux_layers=[2, 15, 30], num_target_layers=31) == []  # 30 < L: the same state
    p = gguf.check_against(info, aux_layers=[2, 15, 30], num_target_layers=29)
    assert any("beyond the target's 29: llama.cpp aborts" in x for x in p), p
    assert gguf.describe_target_layers([2, 31], 30) == [
        "2: the input of target layer 2 = output of layer 1 = HF hidden_states[2]",
        "31: beyond the target's 30 layers: llama.cpp aborts"]


@pytest.mark.parametrize("arch, says", [
    ("LlamaForCausalLM", "llama (src/models/llama.cpp) never sets t_h_nextn"),   # SmolLM2, Llama
    ("llama", "llama (src/models/llama.cpp) never sets t_h_nextn"),              # a target GGUF's architecture
    ("Qwen3ForCausalLM", "qwen3 (src/models/qwen3.cpp) never sets t_h_nextn"),
    ("Qwen3_5ForCausalLM", "qwen35 (src/models/qwen35.cpp) fills it AFTER the final norm"),
    ("SomeNewForCausalLM", "SomeNewForCausalLM (its graph under src/models/) never sets t_h_nextn"),
    (None, "the target's architecture is unknown here")])
def test_id_l_is_refused_where_llama_cpp_does_not_fill_it_before_the_final_norm(tmp_path, arch, says):
    info = gguf.read_drafter(_write_gguf(tmp_path / "a.gguf", target_layers=(2, 15, 30)))
    p = gguf.check_against(info, aux_layers=[2, 15, 30], num_target_layers=30, target_arch=arch)
    assert len(p) == 1 and "target layer id 30 (= L" in p[0] and says in p[0], p
    assert "llama_get_embeddings_nextn (common/speculative.cpp)" in p[0]
    for ok in ("gpt-oss", "GptOssForCausalLM", "mimo2", "step35"):  # the graphs that fill it before the norm
        assert gguf.check_against(info, aux_layers=[2, 15, 30], num_target_layers=30, target_arch=ok) == [], ok
    # inspect refuses it too; the architecture from a features manifest's target class
    manifest = _manifest(tmp_path / "features", [2, 15, 30])
    m = json.loads(manifest.read_text())
    m["target"] = {"class": arch}
    manifest.write_text(json.dumps(m))
    r = inspect_gguf(tmp_path / "a.gguf", features=manifest)
    assert any(says in e for e in r["errors"]), r["errors"]


def _tiny_drafter(path, aux=None):
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                      vocab_size=16, draft_vocab_size=4, target_hidden_size=8, num_target_layers=8, aux_layer_ids=aux)
    d = Eagle3Drafter(c)
    ids = torch.tensor([1, 3, 5, 7])
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab(ids - torch.arange(4), t2d)
    save_drafter(d, path)
    return path


def test_inspect_of_a_checkpoint_says_what_the_converter_writes(tmp_path, capsys):
    d = _tiny_drafter(tmp_path / "d")
    r = inspect_checkpoint(d)
    lc = r["engines"]["llamacpp"]
    assert lc["target_layers"] == [2, 4, 5] and r["errors"] == [] and r["warnings"] == []  # [2, 8//2, 8-3]
    assert lc["target_layers_meaning"][0] == "2: the input of target layer 2 = output of layer 1 = HF hidden_states[2]"
    assert lc["embedding"].startswith("none in the file")
    # custom ids in both forms are carried
    assert inspect_checkpoint(_tiny_drafter(tmp_path / "c", aux=[1, 3, 6]))["engines"]["llamacpp"][
        "target_layers"] == [1, 3, 6]
    # against the features it was trained on: the same layers pass, others are an error naming llama.cpp
    assert inspect_checkpoint(d, features=_manifest(tmp_path / "f1", [2, 4, 5], num_layers=8))["errors"] == []
    bad = _manifest(tmp_path / "f2", [2, 4, 6], num_layers=8)
    r = inspect_checkpoint(d, features=bad)
    assert r["errors"] == [f"llama.cpp: the converter would write eagle3.target_layers [2, 4, 5], the features the "
                           f"drafter was trained on ({bad} aux_layers) are HF [2, 4, 6]"]
    assert main(["inspect", str(d), "--features", str(bad)]) == 1
    assert main(["inspect", str(d), "--drafter", str(d)]) == 2  # --drafter is for a .gguf
    capsys.readouterr()


@pytest.mark.slow  # the tokenizer of the embedded target and four converter runs
def test_a_gguf_of_another_checkpoint_with_the_same_vocab_and_layers_is_refused(converted, tmp_path):
    d_dir, path = converted["default"]
    info = gguf.read_drafter(path)
    assert gguf.check_against(info, drafter_dir=d_dir) == []  # the control: the checkpoint it came from
    for name, eyas_name, gguf_name in (("fc", "fc.weight", "fc.weight"), ("norm", "norm.weight", "output_norm.weight")):
        other = tmp_path / name  # the same drafter retrained: one weight moved by one float32 step
        shutil.copytree(d_dir, other)
        w = load_safetensors(other / "model.safetensors")
        w[eyas_name].view(-1)[7] = torch.nextafter(w[eyas_name].view(-1)[7], torch.tensor(10.0))
        save_file(w, str(other / "model.safetensors"))
        assert gguf.check_against(info, drafter_dir=other) == [
            f"{path}: {gguf_name} is not {other / 'model.safetensors'}'s {eyas_name} (at the GGUF's F32): the file was "
            f"converted from another checkpoint (another drafter's GGUF, or one from before this drafter was "
            f"retrained); convert it again"], name


@pytest.mark.slow  # the tokenizer of the embedded target and four converter runs
def test_the_converters_rope_passes_and_edits_of_the_file_are_refused_before_serving(converted, tmp_path):
    d_dir, out = converted["llama3"]
    assert gguf_fields.digest_problem(out) is None  # recorded by convert
    info = gguf.require_served_as_trained(out, d_dir, L)  # the control: the converter's own file passes
    assert "rope_freqs.weight" in info["tensors"] and "rope.scaling.type" not in info["metadata"]
    cases = {"theta": ({"eagle3.rope.freq_base": 10000.0}, (), None, "RoPE rope.freq_base 10000"),
             "dropped": ({}, ("rope_freqs.weight",), None, "rope_freqs.weight absent: llama.cpp's frequencies differ"),
             "eps": ({"eagle3.attention.layer_norm_rms_epsilon": 1e-6}, (), None, "eagle3.attention.layer_norm_rms"),
             "zeroed": ({}, (), "blk.0.ffn_up.weight", "its bytes changed after export")}
    for name, (keys, drop, zero, msg) in cases.items():
        bad = rewrite_gguf(out, tmp_path / f"{name}.gguf", keys, drop, zero)
        shutil.copy(gguf_fields.digest_path(out), gguf_fields.digest_path(bad))  # exported, then changed
        if name != "zeroed":
            gguf_fields.write_digest(bad)  # its own digest: the field check alone must refuse it
        with pytest.raises(gguf.ServeMismatchError, match=msg):
            gguf.require_served_as_trained(bad, d_dir, L)
    # a zeroed block in a weight no field or weight check compares: only the digest refuses it
    assert gguf.check_against(gguf.read_drafter(tmp_path / "zeroed.gguf"), drafter_dir=d_dir, num_target_layers=L) == []
