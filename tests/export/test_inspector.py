"""``eyas inspect`` and the speculators layout: both layouts are described correctly (keys each
engine would skip, defaults it would assume, the embedding's fate), the round trip eyas ->
speculators -> load_drafter is bit-exact, and the CLI entry point runs."""

import json
import subprocess
import sys

import pytest
import torch

from eyas.cli import main
from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export.eagle import ExportError, save_drafter
from eyas.export.inspector import inspect_checkpoint, render
from eyas.export.load import load_drafter
from eyas.export.speculators import SpeculatorsFormatError, read_speculators, write_speculators
from eyas.io import load_safetensors, save_safetensors
from eyas.vocab.mapping import VocabMapping, save_mapping

V, VD, H = 16, 4, 8
LAYER_KEYS = ["hidden_norm.weight", "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "post_attention_layernorm.weight", "self_attn.k_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight"]


def make_drafter(tids=(1, 3, 5, 7), aux=None, seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=H, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=4, vocab_size=V, draft_vocab_size=len(tids), target_hidden_size=H,
                      num_target_layers=8, aux_layer_ids=aux)
    d = Eagle3Drafter(c)
    for p in d.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    tids = torch.tensor(tids)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tids] = True
    d.set_vocab(tids - torch.arange(len(tids)), t2d)
    d.set_embedding(torch.randn(V, H))
    return d


def edit_config(path, **changes):
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


# --- eyas layout ----------------------------------------------------------------------------

def test_inspect_eyas_checkpoint(tmp_path):
    save_drafter(make_drafter(), tmp_path / "d")
    r = inspect_checkpoint(tmp_path / "d")
    assert r["layout"] == "eagle" and r["errors"] == [] and r["warnings"] == []
    assert r["config"]["fc_input_width"] == 3 * H and r["config"]["fc_n_aux"] == 3
    assert r["aux_layers"]["is_default"] is True
    assert r["aux_layers"]["sglang_captures_hf"] == r["aux_layers"]["vllm_captures_hf"] == [2, 4, 5]
    assert r["vocab"]["valid"] is True and r["vocab"]["order"] == "target_id"
    assert r["vocab"]["first_target_ids"] == [1, 3, 5, 7]
    sg, vl = r["engines"]["sglang"], r["engines"]["vllm"]
    assert sg["skipped_keys"] == [] and sg["ignored_keys"] == ["t2d"]
    assert sg["embedding"] == "the target's embedding"
    assert vl["skipped_keys"] == ["t2d"] and vl["unknown_keys"] == []
    assert any("norm_before_residual = False" in a for a in vl["assumes"])
    text = render(r)
    assert "OK: no problems found" in text and "LlamaForCausalLMEagle3" in text


def test_inspect_flags_frequency_order_missing_draft_vocab_and_embedding(tmp_path):
    d = make_drafter(tids=(7, 1, 5, 3))  # frequency-ordered: target ids not ascending
    save_drafter(d, tmp_path / "d")
    t = load_safetensors(tmp_path / "d" / "model.safetensors")
    t["embed_tokens.weight"] = d.embed_tokens.weight.detach().clone()
    save_safetensors(t, tmp_path / "d" / "model.safetensors")
    r = inspect_checkpoint(tmp_path / "d")
    assert r["vocab"]["order"].startswith("other")
    assert any("not ordered by target id" in w for w in r["warnings"])
    assert "DISCARDED" in r["engines"]["sglang"]["embedding"]
    assert "unless torch.equal" in r["engines"]["vllm"]["embedding"]
    # no draft_vocab_size: SGLang serves the full vocab with the TARGET's lm_head
    edit_config(tmp_path / "d", draft_vocab_size=None)
    r = inspect_checkpoint(tmp_path / "d")
    assert any("TARGET's lm_head" in a for a in r["engines"]["sglang"]["assumes"])
    assert any("draft_vocab_size = vocab_size" in a for a in r["engines"]["vllm"]["assumes"])


def test_inspect_reduced_vocab_without_d2t(tmp_path):
    save_drafter(make_drafter(), tmp_path / "d")
    t = load_safetensors(tmp_path / "d" / "model.safetensors")
    del t["d2t"]
    save_safetensors(t, tmp_path / "d" / "model.safetensors")
    r = inspect_checkpoint(tmp_path / "d")
    assert any("without d2t" in e and "identity" in e for e in r["errors"])
    assert any("identity map" in a for a in r["engines"]["vllm"]["assumes"])
    assert any("missing tensor(s) ['d2t']" in e for e in r["errors"])


def test_inspect_layer_forms(tmp_path):
    save_drafter(make_drafter(aux=[2, 4, 7]), tmp_path / "d")  # SGLang form [1, 3, 6]: unambiguous
    r = inspect_checkpoint(tmp_path / "d")
    assert r["warnings"] == []
    assert r["aux_layers"]["sglang_captures_hf"] == [2, 4, 7] == r["aux_layers"]["vllm_captures_hf"]
    edit_config(tmp_path / "d", eagle_config=None)  # only the vLLM form left
    r = inspect_checkpoint(tmp_path / "d")
    assert r["aux_layers"]["sglang_captures_hf"] == [2, 4, 5]  # SGLang falls back to its default
    assert any("SGLang reads eagle_config only" in w for w in r["warnings"])
    # fc width that disagrees with the declared layers is an error
    edit_config(tmp_path / "d", eagle_aux_hidden_state_layer_ids=[2, 7])
    r = inspect_checkpoint(tmp_path / "d")
    assert any("fc width holds 3" in e for e in r["errors"])


def test_inspect_foreign_config_needs_layer_count(tmp_path):
    save_drafter(make_drafter(), tmp_path / "d")
    edit_config(tmp_path / "d", eyas=None)
    r = inspect_checkpoint(tmp_path / "d")
    assert any("--num-target-layers" in w for w in r["warnings"])
    r = inspect_checkpoint(tmp_path / "d", num_target_layers=8)
    assert r["warnings"] == [] and r["aux_layers"]["hf_hidden_states_indices"] == [2, 4, 5]


def test_inspect_against_a_vocab_dir(tmp_path):
    save_drafter(make_drafter(tids=(1, 3, 5, 7)), tmp_path / "d")

    def vocab(name, tids):
        tids = torch.tensor(tids)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[tids] = True
        save_mapping(tmp_path / name, VocabMapping(tids - torch.arange(len(tids)), t2d),
                     torch.zeros(V, dtype=torch.int64), {})
        return tmp_path / name

    # [1,3,5,7] vs [1,3,6,7]: positions 0, 1, 3 agree; tokens 1, 3, 7 shared
    c = inspect_checkpoint(tmp_path / "d", vocab_dir=vocab("a", (1, 3, 6, 7)))["compare_vocab"]
    assert (c["positions_agree"], c["shared_tokens"]) == (3, 3)
    # [1,3,5,7] vs frequency-ordered [3,1,5,7]: positions 2, 3 agree; all 4 tokens shared
    r = inspect_checkpoint(tmp_path / "d", vocab_dir=vocab("b", (3, 1, 5, 7)))
    assert (r["compare_vocab"]["positions_agree"], r["compare_vocab"]["shared_tokens"]) == (2, 4)
    assert any("remap" in w for w in r["warnings"])


def test_inspect_against_a_vocab_dir_of_another_target(tmp_path, capsys):
    save_drafter(make_drafter(tids=(1, 3, 5, 7)), tmp_path / "d")
    # the same draft target ids, but built over a 2V-token target vocab: another tokenizer
    tids = torch.tensor((1, 3, 5, 7))
    t2d = torch.zeros(2 * V, dtype=torch.bool)
    t2d[tids] = True
    save_mapping(tmp_path / "v", VocabMapping(tids - torch.arange(4), t2d), torch.zeros(2 * V, dtype=torch.int64), {})
    r = inspect_checkpoint(tmp_path / "d", vocab_dir=tmp_path / "v")
    msg = (f"target vocab mismatch: {tmp_path / 'v'} maps a target vocab of 32 tokens, the checkpoint's "
           f"target has 16: they are for different targets (remap cannot bridge them)")
    assert r["errors"] == [msg]
    assert r["compare_vocab"] == {"vocab_dir": str(tmp_path / "v"), "vocab_size_checkpoint": 16,
                                  "vocab_size_vocab_dir": 32, "error": msg}
    assert main(["inspect", str(tmp_path / "d"), "--vocab", str(tmp_path / "v")]) == 1
    assert f"ERROR   {msg}" in capsys.readouterr().out.splitlines()


# --- speculators layout ------------------------------------------------------------------------

def test_write_speculators_layout(tmp_path):
    d = make_drafter(aux=[1, 3, 7])
    write_speculators(d, tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["transformer_layer_config"]["vocab_size"] == V
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 7]  # top-level, HF indices
    assert "eagle_config" not in cfg
    assert cfg["norm_before_residual"] is False
    assert cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == H
    names = set(load_safetensors(tmp_path / "s" / "model.safetensors"))
    assert {f"layers.0.{k}" for k in LAYER_KEYS} <= names
    assert not any(n.startswith("midlayer.") for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"} <= names


def test_inspect_speculators_checkpoint(tmp_path):
    write_speculators(make_drafter(aux=[1, 3, 7]), tmp_path / "s")
    r = inspect_checkpoint(tmp_path / "s")
    assert r["layout"] == "speculators" and r["errors"] == []
    sg, vl = r["engines"]["sglang"], r["engines"]["vllm"]
    # SGLang would silently skip the whole decoder layer (names it has no parameter for)
    assert sg["skipped_keys"] == sorted(f"layers.0.{k}" for k in LAYER_KEYS)
    assert any("RANDOM init" in w for w in r["warnings"])
    assert "DISCARDED" in sg["embedding"]
    assert "not LlamaForCausalLMEagle3" in sg["architecture"]
    assert r["aux_layers"]["sglang_captures_hf"] == [2, 4, 5]
    # vLLM reads the speculators form: top-level ids verbatim, t2d skipped
    assert r["aux_layers"]["vllm_captures_hf"] == [1, 3, 7]
    assert vl["skipped_keys"] == ["t2d"] and vl["unknown_keys"] == []
    assert any(a == "norm_before_residual = False" for a in vl["assumes"])
    assert "Eagle3Speculator" in render(r)


def test_speculators_without_norm_before_residual(tmp_path):
    write_speculators(make_drafter(), tmp_path / "s")
    edit_config(tmp_path / "s", norm_before_residual=None)
    r = inspect_checkpoint(tmp_path / "s")
    assert any("vLLM assumes TRUE" in a for a in r["engines"]["vllm"]["assumes"])
    assert any("without norm_before_residual" in w for w in r["warnings"])
    edit_config(tmp_path / "s", norm_before_residual=True)
    with pytest.raises(ExportError, match="norm_before_residual: true"):
        load_drafter(tmp_path / "s")
    assert any("norm_before_residual: true" in e for e in inspect_checkpoint(tmp_path / "s")["errors"])


def test_roundtrip_eyas_speculators_eyas_is_bit_exact(tmp_path):
    d = make_drafter(tids=(9, 2, 14, 0), aux=[1, 3, 7])
    save_drafter(d, tmp_path / "e")
    write_speculators(load_drafter(tmp_path / "e"), tmp_path / "s")
    back = load_drafter(tmp_path / "s")
    assert back.config.aux_layer_ids == [1, 3, 7]
    assert back.config.draft_vocab_size == 4 and back.config.vocab_size == V
    a, b = d.state_dict_for_export(), back.state_dict_for_export()
    assert set(a) == set(b)
    # the speculators export puts draft ids in ascending target id (9, 2, 14, 0 -> 0, 2, 9, 14):
    # lm_head rows and d2t move together, every other tensor is unchanged
    perm = torch.tensor([3, 1, 0, 2])
    assert torch.equal(back.draft_to_target(torch.arange(4)), torch.tensor([0, 2, 9, 14]))
    assert torch.equal(b["lm_head.weight"], a["lm_head.weight"][perm])
    for k in set(a) - {"lm_head.weight", "d2t"}:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    # and back to the eyas layout again, then through speculators once more: same bytes on disk
    save_drafter(back, tmp_path / "e2")
    write_speculators(load_drafter(tmp_path / "e2"), tmp_path / "s2")
    save_drafter(load_drafter(tmp_path / "s2"), tmp_path / "e3")
    assert (tmp_path / "e2" / "model.safetensors").read_bytes() == (tmp_path / "e3" / "model.safetensors").read_bytes()


def test_load_speculators_drops_verifier_copies_and_reads_llama_defaults(tmp_path):
    write_speculators(make_drafter(), tmp_path / "s")
    t = load_safetensors(tmp_path / "s" / "model.safetensors")
    t["verifier_lm_head.weight"] = torch.zeros(VD, H)
    save_safetensors(t, tmp_path / "s" / "model.safetensors")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    del cfg["transformer_layer_config"]["rms_norm_eps"]  # to_diff_dict() omits LlamaConfig defaults
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    back = load_drafter(tmp_path / "s")
    assert back.config.rms_norm_eps == 1e-6  # LlamaConfig's default, not eyas' 1e-5
    assert "verifier_lm_head.weight" in inspect_checkpoint(tmp_path / "s")["engines"]["vllm"]["unknown_keys"]


def test_speculators_variants_refused(tmp_path):
    write_speculators(make_drafter(), tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    del cfg["transformer_layer_config"]["model_type"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpeculatorsFormatError, match="Qwen3Config"):
        read_speculators(tmp_path / "s")
    write_speculators(make_drafter(), tmp_path / "s2")
    t = load_safetensors(tmp_path / "s2" / "model.safetensors")
    t["layers.1.input_layernorm.weight"] = torch.ones(H)
    save_safetensors(t, tmp_path / "s2" / "model.safetensors")
    with pytest.raises(SpeculatorsFormatError, match=r"decoder layers \['1'\]"):
        load_drafter(tmp_path / "s2")


# --- the CLI -------------------------------------------------------------------------------------

def test_cli_main_in_process(tmp_path, capsys):
    save_drafter(make_drafter(), tmp_path / "d")
    assert main(["inspect", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "vocab mapping" in out and "sglang" in out and "vllm" in out
    assert main(["inspect", str(tmp_path / "d"), "--json", "--num-target-layers", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "eagle"
    t = load_safetensors(tmp_path / "d" / "model.safetensors")
    t["d2t"] = torch.tensor([1, 3, 5, 7])  # absolute ids: an error -> exit status 1
    save_safetensors(t, tmp_path / "d" / "model.safetensors")
    assert main(["inspect", str(tmp_path / "d")]) == 1
    assert "ABSOLUTE" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_module_entry_runs(tmp_path):
    write_speculators(make_drafter(), tmp_path / "s")
    p = subprocess.run([sys.executable, "-m", "eyas.cli", "inspect", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "speculators layout" in p.stdout and "layers.0.self_attn.q_proj.weight" in p.stdout


def test_hardcoded_llama_defaults_match_transformers():
    import transformers

    from eyas.export.speculators import LLAMA_DEFAULTS
    c = transformers.LlamaConfig()
    rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", None)
    for k, v in LLAMA_DEFAULTS.items():
        assert (rope if k == "rope_theta" else getattr(c, k)) == v, k
