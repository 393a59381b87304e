"""Aux hidden-state layers: what eyas captures, what it writes into the drafter config, and what it
refuses. Hand-worked ids; the capture is compared with HF ``output_hidden_states`` directly."""

import json

import pytest
import torch
import transformers

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export.eagle import ExportError, save_drafter, to_hf_config
from eyas.export.load import load_drafter
from eyas.features import LAYER_CONVENTION, FeatureError, check_compatible
from eyas.target import layers
from eyas.target.model import Target


@pytest.fixture(scope="module")
def tiny_target():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model: thread hand-offs cost more than they give
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    yield Target(model, tokenizer=None, identity={})
    torch.set_num_threads(threads)


def _cfg(aux=None, L=8, target_hidden=32) -> DrafterConfig:
    return DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=128, draft_vocab_size=128, target_hidden_size=target_hidden,
                         num_target_layers=L, aux_layer_ids=aux)


def _drafter(aux=None) -> Eagle3Drafter:
    torch.manual_seed(1)
    d = Eagle3Drafter(_cfg(aux))
    d.set_vocab(torch.zeros(128, dtype=torch.int64), torch.ones(128, dtype=torch.bool))  # identity map
    return d


# --- the conventions, by hand ---------------------------------------------------------------

def test_default_ids_by_hand():
    assert layers.default_hf_indices(32) == [2, 16, 29]  # Llama-3.1-8B: outputs of layers 1, 15, 28
    assert layers.default_hf_indices(30) == [2, 15, 27]  # SmolLM2-135M
    assert layers.default_hf_indices(8) == [2, 4, 5]
    assert layers.to_sglang([2, 16, 29]) == [1, 15, 28]
    assert layers.from_sglang([1, 15, 28]) == [2, 16, 29]
    assert layers.normalise([2, 16, 29], 32) is None  # spelled-out default == default
    assert layers.normalise([1, 15, 28], 32) == [1, 15, 28]


@pytest.mark.parametrize("ids, bad", [([0, 3, 5], "0"), ([2, 9], "9"), ([5, 2, 7], "ascending"),
                                      ([2, 2, 5], "unique"), ([], "empty")])
def test_invalid_ids_refused(ids, bad):
    with pytest.raises(layers.LayerIdError, match=bad):
        layers.validate(ids, 8)


# the default [2, L//2, L-3] worked by hand on small targets: out of range, repeated, not ascending
@pytest.mark.parametrize("L, resolved", [(2, r"\[2, 1, -1\]"), (3, r"\[2, 1, 0\]"), (4, r"\[2, 2, 1\]"),
                                         (5, r"\[2, 2, 2\]"), (6, r"\[2, 3, 3\]")])
def test_default_ids_refused_on_small_targets(L, resolved):
    """The default goes through the same validation as explicit ids: every path that resolves it
    (capture, the drafter config, the export) refuses it, naming the layer count, the ids and the
    key to set instead."""
    msg = rf"{L} decoder layers are {resolved}.*extract\.aux_layers"
    for f in (layers.default_hf_indices, lambda n: layers.resolve(None, n), lambda n: layers.normalise(None, n)):
        with pytest.raises(layers.LayerIdError, match=msg):
            f(L)
    with pytest.raises(layers.LayerIdError, match=msg):
        _cfg(None, L=L).resolved_aux_layers()
    with pytest.raises(layers.LayerIdError, match=msg):
        to_hf_config(_cfg(None, L=L))
    # negative controls: the smallest target whose default is valid; explicit ids on a small one
    assert layers.resolve(None, 7) == [2, 3, 4] and layers.normalise(None, 7) is None
    explicit = [1, 2, 3][:L - 1] + [L]  # [1, 2] for L = 2, [1, 2, 3, 4] for L = 4
    assert layers.normalise(explicit, L) == explicit and _cfg(explicit, L=L).resolved_aux_layers() == explicit


# --- (a) capture == HF output_hidden_states[k], ascending --------------------------------------

@pytest.mark.parametrize("aux, expect", [(None, [2, 4, 5]), ([1, 3, 7], [1, 3, 7])])
def test_capture_is_hf_hidden_states_in_ascending_order(tiny_target, aux, expect):
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (2, 7))
    mask = torch.ones_like(ids)
    got = tiny_target.capture(ids, mask, aux)
    with torch.no_grad():
        out = tiny_target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == 9
    assert got["aux_hidden"].shape == (2, 7, 3 * 32)
    for j, k in enumerate(expect):  # slice j of the concatenation is HF index expect[j]
        assert torch.equal(got["aux_hidden"][..., 32 * j:32 * (j + 1)], hs[k]), (j, k)
    # and not some other layer: neighbouring indices differ
    assert not torch.equal(got["aux_hidden"][..., :32], hs[expect[0] + 1])
    assert torch.equal(got["final_hidden"], hs[8])  # post-norm final state
    assert torch.equal(got["target_argmax"], out.logits.argmax(-1))


def test_id_L_is_the_pre_norm_residual_in_every_capture(tiny_target):
    """Aux id L (8 here, as GPT-OSS's [24, 30, 36] of 36) is the last decoder layer's output, before
    the final norm, as vLLM and SGLang (with its fix) serve it: taken here by a hook on
    the last decoder layer, independently of eyas' hook on the norm. Negative control: it is not
    HF's post-norm hidden_states[8] (which is the norm of it). Speculative decoding feeds the
    drafter the same states as extract stores (cached forwards: close, not bit-equal)."""
    from eyas.eval.speculative import speculative_generate

    m = tiny_target.model
    torch.manual_seed(3)
    ids = torch.randint(0, 128, (1, 9))
    last = {}
    h = m.model.layers[-1].register_forward_hook(lambda _m, _a, out: last.setdefault("out", out))
    try:
        with torch.no_grad():
            hs = m(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        h.remove()
    pre = last["out"][0] if isinstance(last["out"], tuple) else last["out"]
    got = tiny_target.capture(ids, torch.ones_like(ids), [2, 4, 8])["aux_hidden"]
    assert torch.equal(got[..., :32], hs[2]) and torch.equal(got[..., 32:64], hs[4])
    assert torch.equal(got[..., 64:], pre)
    assert not torch.allclose(got[..., 64:], hs[8], atol=1e-3)  # not the post-norm state
    with torch.no_grad():
        assert torch.allclose(m.model.norm(got[..., 64:]), hs[8], atol=1e-6)
    torch.manual_seed(1)
    d = Eagle3Drafter(DrafterConfig.for_target(m.config, draft_vocab_size=128, aux_layer_ids=[2, 4, 8])).eval()
    d.set_embedding(m.get_input_embeddings().weight)
    d.set_vocab(torch.zeros(128, dtype=torch.int64), torch.ones(128, dtype=torch.bool))
    out = speculative_generate(m, d, ids[0].tolist(), num_draft_tokens=2, max_new_tokens=4, stop_ids=[],
                               aux_layer_ids=None, return_features=True)
    seq = torch.tensor([ids[0].tolist() + out["tokens"][:-1]])
    ref = tiny_target.capture(seq, torch.ones_like(seq), [2, 4, 8])["aux_hidden"]
    assert out["features"].shape == ref.shape
    assert torch.allclose(out["features"], ref, atol=1e-5)


def test_features_with_post_norm_id_L_are_refused(tmp_path):
    """A manifest written before eyas captured id L pre-norm (no aux_layer_L key) is refused by name
    when it holds id L; one without id L, or with the key, opens."""
    from eyas.features import AUX_AT_L, MANIFEST, PRE_NORM, FeatureStore
    from tests.tiny import tiny_target as tiny
    from tests.tiny import write_features

    store = write_features(tiny(), tmp_path / "f", 2, seed=1, length=8, aux_layers=[2, 4, 8])
    assert store.manifest[AUX_AT_L] == PRE_NORM
    m = json.loads((tmp_path / "f" / MANIFEST).read_text())
    del m[AUX_AT_L]  # as written before
    (tmp_path / "f" / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(FeatureError, match=r"aux layer id 8 \(L\) was captured as 'post-norm hidden_states\[L\]'.*"
                                           r"PR #32334.*re-extract"):
        FeatureStore.open(tmp_path / "f")
    (tmp_path / "f" / MANIFEST).write_text(json.dumps({**m, "aux_layers": [2, 4, 5]}))  # no id L: fine
    assert FeatureStore.open(tmp_path / "f").aux_layers == [2, 4, 5]


def test_describe_says_per_engine_what_id_L_means():
    d = layers.describe([2, 4, 8], 8)
    assert d["id_L"]["id"] == 8
    assert "before the final norm" in d["id_L"]["vllm"] and "46788" in d["id_L"]["vllm"]
    assert "32334" in d["id_L"]["sglang"] and "never captured" in d["id_L"]["sglang"]
    assert "t_h_nextn" in d["id_L"]["llama.cpp"] and "never filled on most, Llama and Qwen3" in d["id_L"]["llama.cpp"]
    assert "id_L" not in layers.describe([2, 4, 7], 8) and "id_L" not in layers.describe(None, 8)


def test_inspect_names_what_id_L_means_per_engine(tmp_path):
    from eyas.export.inspector import inspect_checkpoint

    save_drafter(_drafter([2, 4, 8]), tmp_path / "d")
    r = inspect_checkpoint(tmp_path / "d")
    assert r["aux_layers"]["id_L"]["id"] == 8
    assert any("aux layer id 8 = L" in w and "PR #32334" in w for w in r["warnings"])
    # llama.cpp: unknown target, a warning; a Llama target (its graph never fills id L), an error
    assert any(w.startswith("llama.cpp: eagle3.target_layers [2, 4, 8]: target layer id 8 (= L") and
               "unknown here" in w for w in r["warnings"]), r["warnings"]
    llama = {"num_hidden_layers": 8, "architecture": "LlamaForCausalLM"}
    r = inspect_checkpoint(tmp_path / "d", target=llama)
    assert any(e.startswith("llama.cpp: eagle3.target_layers [2, 4, 8]") and "src/models/llama.cpp" in e
               for e in r["errors"]), r["errors"]
    assert not any("t_h_nextn" in e for e in inspect_checkpoint(
        tmp_path / "d", target={**llama, "architecture": "GptOssForCausalLM"})["errors"])  # its graph fills it
    save_drafter(_drafter([2, 4, 7]), tmp_path / "e")  # negative control: no id L, no such warning
    assert not any("= L" in w for w in inspect_checkpoint(tmp_path / "e")["warnings"])


def test_capture_refuses_unordered_ids(tiny_target):
    ids = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(layers.LayerIdError, match="ascending"):
        tiny_target.capture(ids, torch.ones_like(ids), [7, 1, 3])


# --- (b) what the exported config says ------------------------------------------------------

def test_default_layers_write_no_ids(tmp_path):
    for aux in (None, [2, 4, 5]):  # None and the spelled-out default are the same drafter
        cfg = to_hf_config(_cfg(aux))
        assert "eagle_aux_hidden_state_layer_ids" not in cfg
        assert "eagle_config" not in cfg
    save_drafter(_drafter(), tmp_path / "d")
    on_disk = json.loads((tmp_path / "d" / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in on_disk and "eagle_config" not in on_disk


def test_custom_layers_write_both_engine_forms(tmp_path):
    save_drafter(_drafter([1, 3, 7]), tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 7]  # vLLM: HF indices, top level
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 6],  # SGLang: HF - 1
                                   "use_aux_hidden_state": True}
    back = load_drafter(tmp_path / "d")
    assert back.config.aux_layer_ids == [1, 3, 7]
    assert back.config.resolved_aux_layers() == [1, 3, 7]


def test_config_forms_that_disagree_are_refused():
    cfg = {"eagle_aux_hidden_state_layer_ids": [1, 3, 7],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}}  # SGLang form should be [0, 2, 6]
    with pytest.raises(layers.LayerIdError, match=r"\[1, 3, 7\].*\[2, 4, 8\]"):
        layers.from_config(cfg, 8)
    # one form alone is read in its own convention
    assert layers.from_config({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 6]}}, 8) == [1, 3, 7]
    assert layers.from_config({"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}, 8) == [1, 3, 7]
    assert layers.from_config({}, 8) is None


def test_describe_flags_sglang_version_ambiguity():
    assert layers.describe([2, 4, 7], 8)["sglang_version_ambiguous"] is False  # SGLang form [1, 3, 6]
    assert layers.describe([1, 3, 7], 8)["sglang_version_ambiguous"] is True   # SGLang form [0, 2, 6]
    assert layers.describe(None, 8)["sglang_version_ambiguous"] is False


# --- (c) features extracted at other layers are refused, naming both -------------------------

def test_check_compatible_refuses_other_layers():
    manifest = {"aux_layers_convention": LAYER_CONVENTION, "aux_layers": [1, 15, 28],
                "hidden_size": 4096, "vocab_size": 128256}
    drafter_layers = _cfg(None, L=32, target_hidden=4096).resolved_aux_layers()
    assert drafter_layers == [2, 16, 29]
    with pytest.raises(FeatureError) as e:
        check_compatible(manifest, aux_layers=drafter_layers, hidden_size=4096, vocab_size=128256,
                         source="drafter config")
    msg = str(e.value)
    assert "[1, 15, 28]" in msg and "[2, 16, 29]" in msg and "drafter config" in msg
    # the matching case passes
    check_compatible({**manifest, "aux_layers": [2, 16, 29]}, aux_layers=drafter_layers, hidden_size=4096,
                     vocab_size=128256, source="drafter config")


def test_check_compatible_refuses_other_convention():
    manifest = {"aux_layers_convention": "sglang_output_of_layer", "aux_layers": [2, 16, 29],
                "hidden_size": 32, "vocab_size": 128}
    with pytest.raises(FeatureError, match="convention"):
        check_compatible(manifest, aux_layers=[2, 16, 29], hidden_size=32, vocab_size=128, source="x")


# --- (d) fc width = n_aux x target hidden, checked before any compute --------------------------

def test_fc_width_mismatch_refused_at_load(tmp_path):
    save_drafter(_drafter(), tmp_path / "d")  # fc.weight [32, 96] = 3 layers x 32
    cfg_path = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    two = dict(cfg, eagle_aux_hidden_state_layer_ids=[2, 5],
               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4], "use_aux_hidden_state": True})
    cfg_path.write_text(json.dumps(two))
    with pytest.raises(ExportError, match=r"fc.weight input width 96 != n_aux \(2.*target_hidden_size \(32\) = 64"):
        load_drafter(tmp_path / "d")
    cfg_path.write_text(json.dumps(dict(cfg, target_hidden_size=48)))
    with pytest.raises(ExportError, match=r"96 != n_aux \(3.*\(48\) = 144"):
        load_drafter(tmp_path / "d")
