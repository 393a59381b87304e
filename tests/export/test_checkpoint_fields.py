"""Every checkpoint field that changes the drafter's math is honoured or refused (issue 16), and the
speculators export is safe to load (issue 25). Values are computed here independently: RoPE tables
by transformers' own ``ROPE_INIT_FUNCTIONS``, acceptance lengths by real speculative decoding."""

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eyas.cli import main
from eyas.drafter.model import DrafterConfig, Eagle3Drafter, rope_cos_sin
from eyas.eval import checks as eval_checks
from eyas.export import engine_keys
from eyas.export.eagle import ExportError, save_drafter
from eyas.export.inspector import inspect_checkpoint, target_summary
from eyas.export.load import load_drafter
from eyas.export.speculators import UnsafeExportError, write_speculators
from eyas.export.verifier import EMBEDDED_UPSTREAM, verifier_identity
from eyas.io import load_safetensors, save_safetensors
from eyas.target import rope
from eyas.target.model import summarise_config
from eyas.vocab.remap import adopt_target_positions

V, H = 16, 8
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def make_drafter(aux=None, rope_scaling=None, theta=10000.0, mpe=2048, seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=H, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=4, vocab_size=V, draft_vocab_size=4, target_hidden_size=H, num_target_layers=8,
                      aux_layer_ids=aux, rope_theta=theta, rope_scaling=rope_scaling, max_position_embeddings=mpe)
    d = Eagle3Drafter(c)
    for p in d.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    tids = torch.tensor([1, 3, 5, 7])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tids] = True
    d.set_vocab(tids - torch.arange(4), t2d)
    d.set_embedding(torch.randn(V, H))
    return d


def edit(path, drop_eyas=False, **changes):
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    if drop_eyas:
        cfg.pop("eyas", None)
    p.write_text(json.dumps(cfg))


# --- 1. norm_output and the other flags -------------------------------------------------------

@pytest.mark.parametrize("flag", ["norm_output", "norm_before_fc", "fc_norm", "attention_bias", "mlp_bias"])
def test_math_changing_flags_are_refused_on_load_and_in_inspect(tmp_path, flag):
    save_drafter(make_drafter(), tmp_path / "d")
    edit(tmp_path / "d", **{flag: True})
    with pytest.raises(ExportError, match=rf"{flag}: true \(eyas implements false; honoured by .*vLLM"):
        load_drafter(tmp_path / "d")
    r = inspect_checkpoint(tmp_path / "d")
    assert any(f"{flag}: true" in e for e in r["errors"])
    assert main(["inspect", str(tmp_path / "d")]) == 1


def test_norm_output_in_a_speculators_checkpoint_is_refused(tmp_path):
    write_speculators(make_drafter(), tmp_path / "s", verifier=verifier_identity("some-org/target"))
    edit(tmp_path / "s", norm_output=True)
    with pytest.raises(ExportError, match="norm_output: true .*EAGLE 3.1"):
        load_drafter(tmp_path / "s")


def test_foreign_checkpoint_flags_checked_without_layer_count(tmp_path, capsys):
    """No eyas record, all four norm flags true, input_norm.weight present (speculators/newer vLLM
    norm_before_fc): inspect reports every flag without --num-target-layers and exits 1, and vLLM's
    model knows input_norm.weight when norm_before_fc is set."""
    save_drafter(make_drafter(), tmp_path / "d")
    t = load_safetensors(tmp_path / "d" / "model.safetensors")
    t["input_norm.weight"] = torch.ones(3 * H)
    save_safetensors(t, tmp_path / "d" / "model.safetensors")
    edit(tmp_path / "d", drop_eyas=True, norm_before_residual=True, norm_before_fc=True, fc_norm=True,
         norm_output=True)
    r = inspect_checkpoint(tmp_path / "d")
    assert r["num_target_layers"] is None
    joined = " ".join(r["errors"])
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert f"{flag}: true" in joined, flag
    assert "input_norm.weight" not in r["engines"]["vllm"]["unknown_keys"]
    assert "input_norm.weight" in r["engines"]["sglang"]["skipped_keys"]
    honoured = " ".join(r["engines"]["vllm"]["non_default_keys"])
    assert "norm_before_residual = True: honoured" in honoured and "norm_before_fc = True: honoured" in honoured
    assert any(x.startswith("norm_before_residual = True: not read") for x in
               r["engines"]["sglang"]["non_default_keys"])
    assert main(["inspect", str(tmp_path / "d")]) == 1


def test_table_covers_every_key_eyas_writes_and_refuses_only_what_it_lacks(tmp_path):
    d = make_drafter(rope_scaling=LLAMA31)
    save_drafter(d, tmp_path / "d")
    written = set(json.loads((tmp_path / "d" / "config.json").read_text())) - {"eyas"}
    assert written <= set(engine_keys.BY_KEY), written - set(engine_keys.BY_KEY)
    assert engine_keys.refusals(json.loads((tmp_path / "d" / "config.json").read_text())) == []
    assert {k.eyas for k in engine_keys.ENGINE_KEYS} <= {"honours", "writes", "refuses", "ignores"}
    md = engine_keys.table_markdown()
    assert md.count("\n") == len(engine_keys.ENGINE_KEYS) + 2 and "`norm_output`" in md


# --- 3. RoPE scaling --------------------------------------------------------------------------

def test_llama3_rope_matches_transformers_and_differs_from_plain():
    """Llama-3.1-8B settings (head_dim 128, theta 5e5, llama3 factor 8): eyas' cos/sin tables equal
    the ones from transformers' ROPE_INIT_FUNCTIONS['llama3']; plain RoPE differs by ~0.3 below
    position 512 (what eyas computed before)."""
    cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=5e5,
                                   rope_scaling=dict(LLAMA31), max_position_embeddings=131072)
    ref_inv, att = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert att == 1.0
    theta, scaling = rope.normalise(cfg)
    assert theta == 5e5 and scaling == LLAMA31
    pos = torch.arange(512)
    ref = pos[:, None].double() * ref_inv.double()[None]
    ref_cos = torch.cat([ref.cos(), ref.cos()], -1)
    cos, sin = rope_cos_sin(pos, 128, theta, torch.float32, scaling)
    assert (cos.double() - ref_cos).abs().max() < 1e-4
    assert torch.allclose(rope.inv_freq(128, theta, scaling), ref_inv, rtol=1e-6, atol=0)
    plain, _ = rope_cos_sin(pos, 128, theta, torch.float32)
    gap = (plain - cos).abs().max().item()
    assert 0.25 < gap <= 2.0, gap


def test_linear_rope_matches_transformers():
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=1e4,
                                   rope_scaling={"rope_type": "linear", "factor": 4.0})
    ref_inv, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu")
    assert torch.allclose(rope.inv_freq(16, *rope.normalise(cfg)), ref_inv, rtol=1e-6, atol=0)


def test_rope_scaling_is_carried_target_to_export_to_reload(tmp_path):
    tc = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=16, num_hidden_layers=8,
                                  num_attention_heads=2, num_key_value_heads=1, rope_theta=5e5,
                                  rope_scaling=dict(LLAMA31), max_position_embeddings=131072)
    summary = summarise_config(tc)
    assert summary["rope_scaling"] == LLAMA31 and summary["rope_theta"] == 5e5
    assert "rope_scaling" not in summarise_config(transformers.LlamaConfig(hidden_size=H, num_attention_heads=2))
    c = DrafterConfig.for_target(tc, draft_vocab_size=4)
    assert c.rope_scaling == LLAMA31
    d = make_drafter(rope_scaling=LLAMA31, theta=5e5)
    save_drafter(d, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["rope_scaling"] == LLAMA31 and cfg["rope_theta"] == 5e5
    back = load_drafter(tmp_path / "a")
    assert back.config.rope_scaling == LLAMA31
    save_drafter(back, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["rope_scaling"] == LLAMA31
    # transformers v5 form (rope_parameters) reads the same
    edit(tmp_path / "b", rope_parameters={**LLAMA31, "rope_theta": 5e5})
    cfg_b = json.loads((tmp_path / "b" / "config.json").read_text())
    del cfg_b["rope_scaling"], cfg_b["rope_theta"]
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg_b))
    assert load_drafter(tmp_path / "b").config.rope_scaling == LLAMA31
    assert "llama3" in inspect_checkpoint(tmp_path / "b")["config"]["rope"]


def test_unimplemented_rope_type_is_refused(tmp_path):
    save_drafter(make_drafter(), tmp_path / "d")
    edit(tmp_path / "d", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    with pytest.raises(ExportError, match="rope_type 'yarn' is not implemented"):
        load_drafter(tmp_path / "d")
    assert any("yarn" in e for e in inspect_checkpoint(tmp_path / "d")["errors"])


# --- 4. remap takes the target's context and RoPE ----------------------------------------------

def test_remap_source_gets_the_targets_context_and_rope(tmp_path):
    src = make_drafter(theta=5e5, mpe=64)
    target_config = {"max_position_embeddings": 512, "rope_theta": 1e4}
    changes = adopt_target_positions(src.config, target_config)
    assert changes == ["max_position_embeddings 64 -> 512 (the target's)",
                       "rope_theta 500000.0 -> 10000.0 (the target's)"]
    save_drafter(src, tmp_path / "r")
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (cfg["max_position_embeddings"], cfg["rope_theta"]) == (512, 1e4) and "rope_scaling" not in cfg
    assert adopt_target_positions(src.config, target_config) == []
    assert adopt_target_positions(src.config, {**target_config, "rope_scaling": dict(LLAMA31)}) == [
        f"rope_scaling None -> {LLAMA31!r} (the target's)"]


# --- 5. inspect --target -----------------------------------------------------------------------

def test_inspect_against_a_target_directory(tmp_path, capsys):
    transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=16, num_hidden_layers=8,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                             rope_theta=1e4).save_pretrained(tmp_path / "t")
    save_drafter(make_drafter(theta=5e5, mpe=64), tmp_path / "d")
    r = inspect_checkpoint(tmp_path / "d", target=target_summary(str(tmp_path / "t")))
    a = r["against_target"]
    assert a["vocab_size"] == {"drafter": V, "target": V, "ok": True}
    assert a["max_position_embeddings"] == {"drafter": 64, "target": 512, "ok": False}
    assert a["rope"]["ok"] is False and "theta 500000" in a["rope"]["drafter"] and "theta 10000" in a["rope"]["target"]
    assert a["aux_layers (HF hidden_states)"]["drafter"] == [2, 4, 5]
    assert any("max_position_embeddings 64 < the target's 512" in w for w in r["warnings"])
    assert r["errors"] == []
    assert main(["inspect", str(tmp_path / "d"), "--target", str(tmp_path / "t")]) == 0
    assert "against the target" in capsys.readouterr().out
    # another target's vocab: an error, exit 1
    transformers.LlamaConfig(vocab_size=2 * V, hidden_size=H, num_hidden_layers=8, num_attention_heads=2
                             ).save_pretrained(tmp_path / "t2")
    assert main(["inspect", str(tmp_path / "d"), "--target", str(tmp_path / "t2")]) == 1


def test_inspect_target_from_a_feature_manifest(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "manifest.json").write_text(json.dumps({"target_config": {
        "vocab_size": V, "hidden_size": H, "num_hidden_layers": 12, "max_position_embeddings": 2048,
        "rope_theta": 10000.0}}))
    save_drafter(make_drafter(), tmp_path / "d")  # built for 8 layers
    r = inspect_checkpoint(tmp_path / "d", target=target_summary(str(tmp_path / "f")))
    assert r["against_target"]["num_target_layers"] == {"drafter": 8, "target": 12, "ok": False}
    assert any("num_target_layers 8 (drafter) != 12 (target)" in e for e in r["errors"])


# --- 6./7. eval checks --------------------------------------------------------------------------

def test_position_check_past_max_position_embeddings():
    r = eval_checks.position_check([24], max_new_tokens=24, num_draft_tokens=3, max_position_embeddings=16)
    assert r["prompts_past_limit"] == 1 and r["max_position_reached"] == 24 + 24 + 3 - 1 and not r["ok"]
    assert "past the drafter's max_position_embeddings 16" in r["warning"]
    ok = eval_checks.position_check([10, 20], max_new_tokens=8, num_draft_tokens=3, max_position_embeddings=64)
    assert ok == {"max_position_embeddings": 64, "max_position_reached": 30, "prompts_past_limit": 0, "ok": True,
                  "warning": None}


def test_zeroed_d2t_gives_accept_len_one_and_is_flagged():
    """A real speculative run of a reduced-vocab drafter whose d2t was zeroed (draft id i proposes
    target id i) on a tiny Llama target: the acceptance length is a real 1.0-ish and is flagged;
    the n-gram floor on repeated prompts is not."""
    from eyas.eval.speculative import evaluate_prompts

    torch.manual_seed(0)
    tgt = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256)).eval()
    c = DrafterConfig.for_target(tgt.config, draft_vocab_size=8, aux_layer_ids=[1, 2, 3])  # L = 4: no valid default
    d = Eagle3Drafter(c).eval()
    d.set_embedding(tgt.get_input_embeddings().weight)
    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[100:108] = True
    d.set_vocab(torch.zeros(8, dtype=torch.int64), t2d)  # zeroed: proposes ids 0..7, never 100..107
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (10,), generator=g).tolist() for _ in range(2)]
    with torch.no_grad():
        m = evaluate_prompts(tgt, d, prompts, num_draft_tokens=3, max_new_tokens=12, stop_ids=[], aux_layer_ids=None)
    flag = eval_checks.misconfiguration(m)
    assert m["accept_len"] <= 1.1 and flag["suspected"], m["accept_len"]
    assert flag["reasons"][0].startswith(f"accept_len {m['accept_len']:.3f} <= 1.1")
    assert eval_checks.misconfiguration({"accept_len": 2.4, "per_position_accept_rate": [0.7, 0.4, 0.2]}) == \
        {"suspected": False, "reasons": [], "note": None, "trained": None}
    assert eval_checks.misconfiguration({"accept_len": 1.3, "per_position_accept_rate": [0.01, 0.0]})["suspected"]


# --- 8. multi-layer engine model ----------------------------------------------------------------

def test_two_layer_checkpoint_engine_model(tmp_path):
    """A 2-layer EAGLE-layout checkpoint with SGLang's names (additional_layers.0.*): SGLang skips
    nothing of it, vLLM does not know additional_layers.0.* (it loads layers.1.*), both say they
    build 2 layers; eyas refuses it even without the target's layer count."""
    save_drafter(make_drafter(), tmp_path / "d")
    t = load_safetensors(tmp_path / "d" / "model.safetensors")
    for k in list(t):
        if k.startswith("midlayer.") and "input_layernorm" not in k:
            w = t[k]
            if "self_attn" in k and k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                w = w[:, :H]  # layers >= 1 take the H-wide hidden state only
            t["additional_layers.0." + k[len("midlayer."):]] = w.clone().contiguous()
    save_safetensors(t, tmp_path / "d" / "model.safetensors")
    edit(tmp_path / "d", drop_eyas=True, num_hidden_layers=2)
    r = inspect_checkpoint(tmp_path / "d")
    assert not any(k.startswith("additional_layers") for k in r["engines"]["sglang"]["skipped_keys"])
    assert any(k.startswith("additional_layers.0.") for k in r["engines"]["vllm"]["unknown_keys"])
    assert "builds 2 layers" in r["engines"]["sglang"]["multi_layer"]
    assert "layers.0..2-1" in r["engines"]["vllm"]["multi_layer"]
    assert any("num_hidden_layers" in e for e in r["errors"])


# --- issue 25: the speculators export -----------------------------------------------------------

def test_verifier_identity_forms(tmp_path):
    assert verifier_identity("meta-llama/Llama-3.1-8B-Instruct", revision="abc") == {
        "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": []},
        "eyas": {"source": "hub", "target_path": "meta-llama/Llama-3.1-8B-Instruct", "revision": "abc"}}
    e = verifier_identity("embedded", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert e["verifier"]["name_or_path"] == EMBEDDED_UPSTREAM == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert e["eyas"]["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and e["eyas"]["source"] == "gguf"
    transformers.LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "t")
    loc = verifier_identity(str(tmp_path / "t"))
    assert loc["verifier"] == {"name_or_path": str(tmp_path / "t"), "architectures": ["LlamaForCausalLM"]}
    assert verifier_identity(str(tmp_path / "t"), name_or_path="/srv/t")["verifier"]["name_or_path"] == "/srv/t"
    with pytest.raises(ValueError, match="upstream="):
        verifier_identity(str(tmp_path), gguf_file="other.gguf")


def test_speculators_export_writes_the_verifier_and_refuses_no_embedding(tmp_path):
    d = make_drafter()
    with pytest.raises(UnsafeExportError, match="uninitialised embedding"):
        write_speculators(d, tmp_path / "x", include_embedding=False)
    assert not (tmp_path / "x").exists()
    write_speculators(d, tmp_path / "s", verifier=verifier_identity("org/target", revision="r1"))
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "org/target", "architectures": []}
    assert cfg["eyas"]["verifier"]["revision"] == "r1"
    r = inspect_checkpoint(tmp_path / "s")
    assert r["engines"]["speculators"]["verifier"] == "org/target"
    assert r["engines"]["speculators"]["embedding"] == "embed_tokens.weight loaded from the file"
    assert not any("name_or_path" in w or "embed_tokens" in w for w in r["warnings"])  # (SGLang's layers.0 one stays)
    # a foreign speculators file without the embedding and without a verifier: both flagged
    t = load_safetensors(tmp_path / "s" / "model.safetensors")
    del t["embed_tokens.weight"]
    save_safetensors(t, tmp_path / "s" / "model.safetensors")
    cfg["speculators_config"]["verifier"]["name_or_path"] = None
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg))
    r = inspect_checkpoint(tmp_path / "s")
    assert r["engines"]["speculators"]["embedding"].startswith("UNSAFE")
    assert any("unsafe to load in speculators 0.9.0" in w for w in r["warnings"])
    assert any("name_or_path is null" in w for w in r["warnings"])


def test_inspect_prints_the_convert_command_for_custom_aux_ids(tmp_path):
    save_drafter(make_drafter(aux=[1, 4, 6]), tmp_path / "c")
    s = inspect_checkpoint(tmp_path / "c")["engines"]["speculators"]
    assert s["convert_command"].endswith("""--algorithm-kwargs '{"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}'""")
    assert any("NOT carried unless passed" in x and "[2, 4, 5]" in x for x in s["convert_changes"])
    assert any("no embed_tokens.weight" in x for x in s["convert_changes"])
    save_drafter(make_drafter(), tmp_path / "d")
    assert "--algorithm-kwargs" not in inspect_checkpoint(tmp_path / "d")["engines"]["speculators"]["convert_command"]


def test_serving_verdict_against_the_ngram_floor_and_greedy():
    # the committed CPU default before the recipe change: scratch chat 1.594 vs the floor's 1.910
    below = eval_checks.serving_verdict({"accept_len": 1.59375, "speedup": 1.30}, {"accept_len": 1.9101123595505618})
    assert below["beats_ngram_floor"] is False and below["faster_than_greedy"] is True
    assert below["worth_serving"] is False and below["accept_len_over_ngram"] == -0.3164
    assert len(below["reasons"]) == 1 and "n-gram floor's 1.910" in below["reasons"][0]
    # above the floor but slower than greedy (HumanEval on 2 cores, speedup 0.78x): not worth serving either
    slow = eval_checks.serving_verdict({"accept_len": 1.8, "speedup": 0.78}, {"accept_len": 1.54})
    assert (slow["beats_ngram_floor"], slow["faster_than_greedy"], slow["worth_serving"]) == (True, False, False)
    assert "0.780 <= 1" in slow["reasons"][0]
    # a tie is not a win: prompt lookup costs nothing to train or run
    tie = eval_checks.serving_verdict({"accept_len": 1.5, "speedup": 2.0}, {"accept_len": 1.5})
    assert tie["worth_serving"] is False
    ok = eval_checks.serving_verdict({"accept_len": 3.19, "speedup": 3.1}, {"accept_len": 1.95})
    assert ok == {"beats_ngram_floor": True, "faster_than_greedy": True, "worth_serving": True,
                  "accept_len_over_ngram": 1.24, "reasons": []}
    # no timing (nothing timed): unknown, not a verdict
    untimed = eval_checks.serving_verdict({"accept_len": 3.0, "speedup": None}, {"accept_len": 1.9})
    assert untimed["worth_serving"] is None
    # ... unless the other test already failed: below the floor settles it, timed or not
    assert eval_checks.serving_verdict({"accept_len": 1.5, "speedup": None}, {"accept_len": 2.0})["worth_serving"] \
        is False
    # a NaN figure is unknown, not a failed test
    nan = eval_checks.serving_verdict({"accept_len": float("nan"), "speedup": 2.0}, {"accept_len": 1.5})
    assert (nan["beats_ngram_floor"], nan["worth_serving"], nan["reasons"]) == (None, None, [])


def test_sampled_verdict_per_temperature_of_the_served_table():
    # the committed CPU run's scratch chat rows: below the floor greedily over 10 prompts, above it sampled
    rows = {"eagle/chain/T0": {"accept_len": 3.0, "ci95": [2.5, 3.75]},
            "ngram/chain/T0": {"accept_len": 1.667, "ci95": [1.364, 2.143]},
            "eagle/tree/T0": {"accept_len": 3.333, "ci95": [3.0, 3.75], "matches_greedy": True},
            "eagle/chain/T0.7": {"accept_len": 1.622, "ci95": [1.5, 1.765]},
            "ngram/chain/T0.7": {"accept_len": 1.2, "ci95": [1.071, 1.364]},
            "eagle/chain/T1": {"accept_len": 1.3, "ci95": [1.3, 1.3]},
            "ngram/chain/T1": {"accept_len": 1.333, "ci95": [1.111, 1.667]}}
    v = eval_checks.sampled_verdict(rows)
    assert set(v) == {"T0.7", "T1"}  # greedy rows and the tree are not sampled rows
    assert v["T0.7"] == {"accept_len": 1.622, "ngram_accept_len": 1.2, "beats_ngram_floor": True, "separated": True}
    assert v["T1"]["beats_ngram_floor"] is False and v["T1"]["separated"] is False
    # an interval missing: no claim about separation; a temperature without its n-gram row: left out
    rows["ngram/chain/T0.7"]["ci95"] = None
    del rows["ngram/chain/T1"]
    assert eval_checks.sampled_verdict(rows) == {"T0.7": {"accept_len": 1.622, "ngram_accept_len": 1.2,
                                                          "beats_ngram_floor": True, "separated": None}}


# --- keys of the speculators layer config are checked, not overwritten; sliding windows ---------

def _edit_layer_config(path, **changes):
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    cfg["transformer_layer_config"].update(changes)
    p.write_text(json.dumps(cfg))


SLIDING = {"layer_types": ["sliding_attention"], "use_sliding_window": True, "sliding_window": 4}


@pytest.mark.parametrize("changes, refused", [
    ({"tie_word_embeddings": True}, ["tie_word_embeddings: true (eyas implements false"]),
    (SLIDING, ['layer_types: ["sliding_attention"]', "sliding_window: 4 (eyas implements null",
               "use_sliding_window: true"]),
    # a window no context reaches is refused too (an engine may serve past max_position_embeddings)
    ({"layer_types": ["sliding_attention"], "sliding_window": 1 << 20}, ["sliding_window: 1048576"]),
    ({"attention_bias": True, "logit_scale": 0.5}, ["attention_bias: true", "logit_scale: 0.5"]),
])
def test_engine_keys_of_the_speculators_layer_config_are_refused_by_name(tmp_path, changes, refused, capsys):
    write_speculators(make_drafter(), tmp_path / "s", verifier=verifier_identity("org/target"))
    load_drafter(tmp_path / "s")  # negative control: the export as written loads
    _edit_layer_config(tmp_path / "s", **changes)
    with pytest.raises(ExportError) as e:
        load_drafter(tmp_path / "s")
    errors = " ".join(inspect_checkpoint(tmp_path / "s")["errors"])
    for r in refused:
        assert r in str(e.value) and r in errors, (r, str(e.value))
    assert main(["inspect", str(tmp_path / "s")]) == 1
    assert refused[0] in capsys.readouterr().out


@pytest.mark.parametrize("changes, ok", [
    (SLIDING, False),
    ({"sliding_window": 4096}, False),
    ({"layer_types": ["full_attention"]}, True),
    # transformers' Qwen2 form of "no window": use_sliding_window false drops sliding_window
    ({"use_sliding_window": False, "sliding_window": 131072, "layer_types": ["full_attention"]}, True),
    ({"sliding_window": None}, True),
])
def test_sliding_window_keys_at_the_top_of_the_eagle_layout(tmp_path, changes, ok):
    save_drafter(make_drafter(), tmp_path / "d")
    edit(tmp_path / "d", **changes)
    if ok:
        load_drafter(tmp_path / "d")
        assert inspect_checkpoint(tmp_path / "d")["errors"] == []
    else:
        with pytest.raises(ExportError, match="sliding_window"):
            load_drafter(tmp_path / "d")
        assert any("sliding_window" in e for e in inspect_checkpoint(tmp_path / "d")["errors"])
