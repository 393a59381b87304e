"""How eyas reads a target's config (eyas/target/).

- The one reader of HF config fields (eyas/target/hf_config.py): head_dim, kv heads and the RoPE base
  (which eyas/target/rope.py's normal form takes), from dicts and transformers config objects.
- The teacher is the target's own distribution: a post-head logit transform is honoured (a scalar)
  or refused by name before anything is extracted (eyas/target/model.py ``check_head``). Each case is
  a real transformers architecture with tiny random weights; the reference is that model's own
  forward logits, computed by transformers.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import LlamaConfig

from eyas.drafter.model import DrafterConfig
from eyas.target import hf_config, rope
from eyas.target.model import Target, TargetError, check_head, summarise_config
from eyas.training.unroll import teacher_logits

# --- the HF config fields --------------------------------------------------------------------------

def test_head_dim_and_kv_heads_from_dicts_and_transformers_configs():
    assert hf_config.head_dim({"hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert hf_config.head_dim({"hidden_size": 2560, "num_attention_heads": 32, "head_dim": 128}) == 128
    assert hf_config.head_dim({"hidden_size": 64, "num_attention_heads": 4, "head_dim": None}) == 16
    assert hf_config.num_key_value_heads({"num_attention_heads": 32}) == 32
    assert hf_config.num_key_value_heads({"num_attention_heads": 32, "num_key_value_heads": 8}) == 8
    c = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    assert (hf_config.head_dim(c), hf_config.num_key_value_heads(c)) == (16, 2)
    with pytest.raises(KeyError, match="num_attention_heads"):
        hf_config.head_dim({"hidden_size": 64})


def test_rope_theta_precedence():
    assert hf_config.rope_theta({}) == 10000.0  # LlamaConfig's default
    assert hf_config.rope_theta({"rope_theta": 5e5}) == 5e5
    assert hf_config.rope_theta({"rope_scaling": {"rope_type": "llama3", "rope_theta": 2e5}}) == 2e5
    v5 = {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert hf_config.rope_theta(v5) == 1e6
    c = LlamaConfig(rope_theta=250000.0)
    assert hf_config.rope_theta(c) == 250000.0  # transformers 4: rope_theta; 5: rope_parameters
    # eyas/target/rope.py's normal form takes its base from the same reader
    assert rope.normalise({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)


# --- the post-head transform: the teacher is the target's own distribution ---------------------

SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)


def _model(name: str, **kw):
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(**SHAPE, **kw)
    return getattr(transformers, f"{name}ForCausalLM")(cfg).eval()


def _teacher_and_reference(model, multiplier):
    """eyas' teacher (the features' final hidden state through the effective lm_head) and the
    target's own log-softmax, on 12 tokens."""
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    t = Target(model, None, {}, multiplier)
    feats = t.capture(ids, torch.ones_like(ids), [1, 2])  # a 2-layer target has no default aux ids
    logits, lse = teacher_logits(feats["final_hidden"], t.head_weights()["lm_head"])
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float().log_softmax(-1)
    return logits.float() - lse[..., None], ref


@pytest.mark.parametrize("name, kw, s", [
    ("Granite", {"logits_scaling": 16.0}, 1 / 16),   # modeling_granite.py divides
    ("Cohere", {"logit_scale": 0.25}, 0.25),         # modeling_cohere.py multiplies
    ("Gemma2", {"final_logit_softcapping": None, "head_dim": 8}, 1.0),
    ("Llama", {}, 1.0),
])
def test_the_teacher_equals_the_targets_own_distribution(name, kw, s):
    model = _model(name, **kw)
    assert check_head(model) == pytest.approx(s)
    ours, ref = _teacher_and_reference(model, s)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    if s != 1.0:  # negative control: lm_head(h) alone, the teacher before, is another distribution
        plain, _ = _teacher_and_reference(model, 1.0)
        assert (plain - ref).abs().max() > 0.1


def test_a_transform_that_is_not_a_scalar_is_refused_by_name():
    model = _model("Gemma2", final_logit_softcapping=30.0, head_dim=8)
    with pytest.raises(TargetError, match=r"Gemma2ForCausalLM \(model_type 'gemma2'\): final_logit_softcapping 30\.0"):
        check_head(model)


def test_an_unlisted_architecture_that_scales_its_logits_is_refused_naming_the_key():
    # HyperCLOVAX multiplies by logits_scaling (modeling_hyperclovax.py), Granite divides by it:
    # the key table lists only what eyas implements, the forward probe catches the rest
    model = _model("HyperCLOVAX", logits_scaling=4.0)
    with pytest.raises(TargetError, match=r"HyperCLOVAXForCausalLM .*not 1 \* lm_head.*'logits_scaling': 4\.0"):
        check_head(model)
    assert check_head(_model("HyperCLOVAX", logits_scaling=1.0)) == 1.0  # negative control: no scaling


def test_a_layernorm_target_is_refused_by_name_not_by_attribute_error():
    cfg = _model("Cohere", logit_scale=0.25).config
    for build in (summarise_config, lambda c: DrafterConfig.for_target(c, 8, [1, 2])):
        with pytest.raises(TargetError, match=r"model_type 'cohere'\) has no rms_norm_eps \(it has layer_norm_eps"):
            build(cfg)
    assert summarise_config(_model("Llama").config)["rms_norm_eps"] == 1e-6  # negative control
