"""A published drafter's own tensors: a source with an embedding of its own is refused by remap's
check (eyas.export.own_tensors.check_source), not fine-tuned over the target's; a source of another
hidden size gets a named error; the step-0 gate does not blame the vocab mapping when remap's
figures clear it; and ``eyas inspect`` warns where the engines serve a tensor differently."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export.eagle import save_drafter
from eyas.export.inspector import inspect_checkpoint, render
from eyas.export.own_tensors import OwnTensorError, check_source
from eyas.training.loop import GateError, step0_gate


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A drafter with an embedding of its own (``own``: in its file; ``bare``: the same drafter
    without it, as eyas saves drafters), and the target's embedding."""
    root = tmp_path_factory.mktemp("own")
    c = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=128, draft_vocab_size=8, target_hidden_size=32, num_target_layers=8)
    d = Eagle3Drafter(c)
    ids = torch.arange(8) * 3
    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab(ids - torch.arange(8), t2d)
    g = torch.Generator().manual_seed(5)
    target_embed, emb = torch.randn(128, 32, generator=g), torch.randn(128, 32, generator=g)
    save_drafter(d, root / "bare")
    save_drafter(d, root / "own")
    w = load_file(root / "own" / "model.safetensors")
    save_file({**w, "embed_tokens.weight": emb}, root / "own" / "model.safetensors")
    return {"root": root, "target_embed": target_embed, "L": 8}


def test_a_source_with_its_own_embedding_is_refused_naming_the_tensor_and_the_engines(own):
    with pytest.raises(OwnTensorError) as e:
        check_source(own["root"] / "own", 32, own["target_embed"])
    msg = str(e.value)
    assert msg.startswith(f"{own['root'] / 'own' / 'model.safetensors'}: embed_tokens.weight is not the target's "
                          f"embedding (128 of 128 rows differ at torch.float32"), msg
    for engine in ("SGLang: discarded", "vLLM: used unless torch.equal", "llama.cpp: used: written as token_embd"):
        assert engine in msg, engine
    # the controls: no embedding in the file, or the target's own (as speculators writes it, at bf16): accepted
    check_source(own["root"] / "bare", 32, own["target_embed"])
    same = own["root"] / "same"
    same.mkdir()
    w = load_file(own["root"] / "bare" / "model.safetensors")
    w["model.embed_tokens.weight"] = own["target_embed"].to(torch.bfloat16)
    save_file(w, same / "model.safetensors")
    check_source(same, 32, own["target_embed"])
    # one weight of one row moved: an embedding of its own (a fine-tuned one moves the rows of its data's tokens)
    w["model.embed_tokens.weight"][7, 3] *= 1.5
    save_file(w, same / "model.safetensors")
    with pytest.raises(OwnTensorError, match=r"1 of 128 rows differ at torch.bfloat16"):
        check_source(same, 32, own["target_embed"])


def test_a_source_of_another_hidden_size_gets_a_named_error(own):
    with pytest.raises(OwnTensorError, match=r"the source drafter's hidden_size 48 != the target's hidden size 32: "
                                             r"it embeds tokens with an embedding of its own width"):
        check_source(own["root"] / "bare", 48, own["target_embed"])


def test_the_gate_does_not_blame_the_mapping_when_remaps_figures_clear_it():
    chance = {"loss_0": 4.5, "acc_0": 0.01}
    cleared = {"source_own_mapping": {"loss_0": 4.5, "acc_0": 0.0105}, "remapped": {"loss_0": 4.5, "acc_0": 0.01}}
    with pytest.raises(GateError) as e:
        step0_gate(96, 0.5, 0.05, False, remap_step0=cleared)(chance)
    msg = str(e.value)
    assert "Causes: not the vocab mapping (remap measured the source under its own mapping at acc_0 0.01050 and the " \
           "remapped drafter at 0.01000" in msg, msg
    assert "does not match its lm_head rows" not in msg and "embed_tokens.weight of its own" in msg
    # remapped far below the source's own: the mapping is named (the control)
    blamed = {"source_own_mapping": {"loss_0": 2.0, "acc_0": 0.4}, "remapped": {"loss_0": 4.5, "acc_0": 0.01}}
    with pytest.raises(GateError, match="a vocab mapping that does not match its lm_head rows"):
        step0_gate(96, 0.5, 0.05, False, remap_step0=blamed)(chance)


def test_inspect_warns_where_the_engines_disagree_about_a_tensor(own):
    r = inspect_checkpoint(own["root"] / "own", num_target_layers=own["L"])
    text = render(r)
    assert "OK: no problems found" not in text
    assert any(w.startswith("engines disagree about embed_tokens.weight: SGLang: discarded") for w in r["warnings"]), \
        r["warnings"]
    assert "WARNING engines disagree about embed_tokens.weight" in text
    bare = inspect_checkpoint(own["root"] / "bare", num_target_layers=own["L"])  # the control
    assert not any("engines disagree" in w for w in bare["warnings"]), bare["warnings"]
