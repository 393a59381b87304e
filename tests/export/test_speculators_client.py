"""The real speculators client (``vllm-project/speculators`` 0.9.0) loads eyas' speculators-layout
export as it is (``Eagle3DraftModel.from_pretrained``, offline: the verifier identity is a local
directory holding the target's config and weights) and computes the same TTT-step logits as eyas.

speculators is a test-only client, not a dependency of eyas: 0.9.0 pins transformers<=5.19 and
pulls torchvision and torchaudio, which its model code does not import, so ``scripts/install.sh``
installs it and the packages its import needs with ``--no-deps`` (CI runs this module). Without
it the module is skipped; installed but not importable (one of those packages missing) fails.

Alignment (speculators ``models/eagle3/core.py`` ``forward``): step 0 embeds the ``input_ids`` it
is given and steps k >= 1 the given ids shifted left by k; positions advance by one per step.
eyas' step k embeds the ids shifted left by 1 + k at positions + k, so speculators is given the
ids shifted left by one and the same positions. Its logits are read from its own ``lm_head``
through a forward hook (the forward returns only the argmax tokens).
"""


import importlib
import importlib.util

import pytest
import torch

if importlib.util.find_spec("speculators") is None:
    pytest.skip("speculators is not installed (scripts/install.sh installs it)", allow_module_level=True)
importlib.import_module("speculators")  # installed: a dependency --no-deps missed is an error, not a skip

from eyas.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eyas.export.speculators import write_speculators  # noqa: E402
from eyas.export.verifier import verifier_identity  # noqa: E402
from eyas.training.batches import shift_left  # noqa: E402

V, VD, H, L, T = 96, 24, 32, 8, 128  # T: one flex-attention block (speculators builds 128-token block masks)


def _drafter(aux, embed, rope_scaling=None):
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=V, draft_vocab_size=VD, target_hidden_size=H, num_target_layers=L, aux_layer_ids=aux,
                      rms_norm_eps=1e-6, rope_theta=500.0, max_position_embeddings=256, rope_scaling=rope_scaling)
    d = Eagle3Drafter(c).eval()
    d.reset_parameters(std=0.2)
    for n in (d.midlayer.input_layernorm, d.midlayer.hidden_norm, d.midlayer.post_attention_layernorm, d.norm):
        n.weight.data = 1 + 0.3 * torch.randn(H)
    tids = torch.randperm(V)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tids] = True
    d.set_vocab(tids - torch.arange(VD), t2d)
    d.set_embedding(embed)
    return d


def _target(tmp_path):
    """A tiny real Llama target saved as a local HF directory (speculators reads its config and
    its embed_tokens / lm_head / norm weights from the verifier path)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "target")
    return model


@pytest.mark.parametrize("aux,rope_scaling", [
    (None, None),
    ([1, 4, 6], {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 16}),
])
def test_speculators_loads_the_export_and_agrees(tmp_path, monkeypatch, aux, rope_scaling):
    from speculators.models.eagle3 import Eagle3DraftModel

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the verifier path is written relative: resolved from here
    target = _target(tmp_path)
    d = _drafter(aux, target.get_input_embeddings().weight, rope_scaling)
    ident = verifier_identity("target")
    assert ident["verifier"] == {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]}
    write_speculators(d, tmp_path / "spec", verifier=ident)
    m = Eagle3DraftModel.from_pretrained(str(tmp_path / "spec")).float().eval()

    assert m.config.eagle_aux_hidden_state_layer_ids == d.config.resolved_aux_layers()
    assert torch.equal(m.d2t, d.d2t) and torch.equal(m.t2d, d.t2d)
    assert torch.equal(m.embed_tokens.weight, d.embed_tokens.weight)

    g = torch.Generator().manual_seed(3)
    aux_h = torch.randn(1, T, d.config.num_aux * H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    pos = torch.arange(T)[None] + 1
    doc = torch.zeros(1, T, dtype=torch.int64)
    seen = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
    with torch.no_grad():
        m(hidden_states=aux_h, input_ids=shift_left(ids, 1, 0), document_ids=doc, position_ids=pos, ttt_steps=3)
    hook.remove()
    assert len(seen) == 3
    with torch.no_grad():
        cache, hidden = [], d.project(aux_h)
        for k in range(3):
            hidden = d.ttt_step(hidden, shift_left(ids, 1 + k, 0), pos + k, doc, cache)
            ours = d.logits(hidden)
            diff = (ours - seen[k]).abs().max().item()
            assert diff < 1e-5, (k, diff)
            assert torch.equal(ours.argmax(-1), seen[k].argmax(-1))


def _speculators_logits(m, aux_h, ids, pos, doc, steps):
    seen = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
    with torch.no_grad():
        m(hidden_states=aux_h, input_ids=shift_left(ids, 1, 0), document_ids=doc, position_ids=pos, ttt_steps=steps)
    hook.remove()
    return seen


def test_a_sliding_window_changes_speculators_forward_and_eyas_refuses_it(tmp_path, monkeypatch):
    """speculators 0.9.0 honours ``layer_types``/``sliding_window`` of the layer config (its
    attention mask gets the window); eyas' attention has none, so it refuses the file by name.
    Negative control: the same file with full attention loads in eyas and agrees with speculators."""
    import json

    from speculators.models.eagle3 import Eagle3DraftModel

    from eyas.export.eagle import ExportError
    from eyas.export.inspector import inspect_checkpoint
    from eyas.export.load import load_drafter

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    target = _target(tmp_path)
    d = _drafter(None, target.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(3)
    aux_h = torch.randn(1, T, d.config.num_aux * H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    pos, doc = torch.arange(T)[None] + 1, torch.zeros(1, T, dtype=torch.int64)
    with torch.no_grad():
        ours = d.logits(d.ttt_step(d.project(aux_h), shift_left(ids, 1, 0), pos, doc, []))
    for name, layer in (("full", {"layer_types": ["full_attention"]}),
                        ("sliding", {"layer_types": ["sliding_attention"], "use_sliding_window": True,
                                     "sliding_window": 4})):
        write_speculators(d, tmp_path / name, verifier=verifier_identity("target"))
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        cfg["transformer_layer_config"].update(layer)
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        m = Eagle3DraftModel.from_pretrained(str(tmp_path / name)).float().eval()
        diff = (_speculators_logits(m, aux_h, ids, pos, doc, 1)[0] - ours).abs().max().item()
        if name == "full":
            assert diff < 1e-5
            load_drafter(tmp_path / name)
        else:
            assert diff > 0.1, diff  # the window changes speculators' step-0 logits
            with pytest.raises(ExportError, match=r'layer_types: \["sliding_attention"\].*sliding_window: 4'):
                load_drafter(tmp_path / name)
            assert any("sliding_window: 4" in e for e in inspect_checkpoint(tmp_path / name)["errors"])


def test_a_frequency_ordered_drafter_is_exported_in_the_order_speculators_assumes(tmp_path, monkeypatch):
    """speculators' verifier_lm_head takes the target's lm_head rows through t2d (ascending target
    id). After eyas' export its row i is the target row of draft id i's own token, and the file
    computes the drafter's distribution over target ids exactly. Negative control: the same file in
    frequency order (as the drafter holds it) gets the rows of other tokens."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eyas.export.inspector import inspect_checkpoint
    from eyas.export.load import load_drafter
    from eyas.io import load_safetensors, save_safetensors

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    target = _target(tmp_path)
    d = _drafter(None, target.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(5)
    tids = torch.randperm(V, generator=g)[:VD]  # frequency order: not ascending
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tids] = True
    d.set_vocab(tids - torch.arange(VD), t2d)
    write_speculators(d, tmp_path / "spec", verifier=verifier_identity("target"))
    # the frequency-ordered form, written directly: what the export was before it sorted
    raw = load_safetensors(tmp_path / "spec" / "model.safetensors")
    (tmp_path / "freq").mkdir()
    (tmp_path / "freq" / "config.json").write_text((tmp_path / "spec" / "config.json").read_text())
    save_safetensors({**raw, "d2t": d.d2t.clone(), "lm_head.weight": d.lm_head.weight.detach().clone()},
                     tmp_path / "freq" / "model.safetensors")
    target_rows = target.lm_head.weight.detach()
    for name in ("spec", "freq"):
        m = Eagle3DraftModel.from_pretrained(str(tmp_path / name)).float().eval()
        m.load_verifier_weights()
        own = target_rows[torch.arange(VD) + m.d2t]  # the target row of each draft id's token
        agree = int((m.verifier_lm_head.weight == own).all(-1).sum())
        assert agree == (VD if name == "spec" else int((tids == tids.sort().values).sum())), (name, agree)
        warned = any("speculators 0.9.0 would train" in w for w in inspect_checkpoint(tmp_path / name)["warnings"])
        assert warned == (name == "freq")
    assert agree < VD // 2
    # the export computes the drafter's logit for every target id, exactly
    e = load_drafter(tmp_path / "spec", num_target_layers=L)
    assert torch.equal(e.draft_to_target(torch.arange(VD)), tids.sort().values)
    h = torch.randn(3, H, generator=g)
    full = torch.full((3, V), float("-inf"))
    ours = full.clone().index_copy_(1, tids, d.logits(h).detach())
    theirs = full.clone().index_copy_(1, e.draft_to_target(torch.arange(VD)), e.logits(h).detach())
    assert torch.equal(ours, theirs)
