"""The training step of eyas/training/loop.py.

- Its CUDA-graph replay (``GraphedTTT``): padding to a static shape leaves the TTT loss, gradients and
  counts unchanged (CPU), and on CUDA one graph replay gives the eager loss and gradients for batches
  whose documents differ (the block mask is rebuilt inside the graph).
- ``clip_in_step``: the clip left to the fused AdamW kernel equals clip_grad_norm_ then the step, with
  the clip active and not, over several steps and two param groups (CPU fused AdamW; CUDA's too on a
  GPU).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from eyas.drafter.backend import Backend
from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.training.batches import Batch, autocast, pad_batch
from eyas.training.loop import GraphedTTT, clip_in_step
from eyas.training.unroll import TTTUnroll, ttt_forward

CFG = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, vocab_size=100, draft_vocab_size=40, target_hidden_size=32, num_target_layers=8)


# what the graphs capture on a GPU: flex attention (its block mask rebuilt inside the graph), compiled
# layers, Triton kernels; on CPU every backend runs plain torch
FAST = Backend(attention="flex", compile=True, compile_layers=True, triton=True, cuda_graphs=True)


def batch(docs: list[list[int]], seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    B, T = len(docs), max(sum(r) for r in docs)
    pos, doc = torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1, dtype=torch.long)
    for b, row in enumerate(docs):
        a = 0
        for i, n in enumerate(row):
            pos[b, a:a + n], doc[b, a:a + n] = torch.arange(n), i
            a += n
    return Batch(input_ids=torch.randint(0, 100, (B, T), generator=g), loss_mask=(doc >= 0) & (pos > 2),
                 aux_hidden=torch.randn(B, T, 96, generator=g), final_hidden=torch.randn(B, T, 32, generator=g),
                 target_argmax=torch.randint(0, 100, (B, T), generator=g), positions=pos, doc_ids=doc,
                 sample_ids=[])


def drafter(device="cpu") -> tuple[Eagle3Drafter, torch.Tensor]:
    torch.manual_seed(0)
    d = Eagle3Drafter(CFG)
    d.embed_tokens.weight.data.normal_()
    d.set_vocab(torch.arange(40) * 2 - torch.arange(40), torch.arange(100) % 2 == 0)  # draft i -> target 2i
    return d.to(device), (torch.randn(40, 32, generator=torch.Generator().manual_seed(5)) * 0.3).to(device)


def loss_grads_counts(d, b, head, ttt=3):
    d.zero_grad(set_to_none=True)
    with autocast(b.input_ids.device):
        loss, _, counts = ttt_forward(d, b, head, ttt, 0.8, backend=FAST)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in d.parameters() if p.requires_grad], counts


def test_pad_batch_keeps_loss_grads_and_counts():
    d, head = drafter()
    b = batch([[7, 9], [12]], seed=1)  # [2, 16]
    p = pad_batch(b, 3, 24)
    assert p.input_ids.shape == (3, 24) and p.aux_hidden.shape == (3, 24, 96)
    assert (p.doc_ids[2] == -1).all() and not p.loss_mask[:, 16:].any() and (p.doc_ids[:, 16:] == -1).all()
    l0, g0, c0 = loss_grads_counts(d, b, head)
    l1, g1, c1 = loss_grads_counts(d, p, head)
    # step 0 supervises t when token t+2 is in t's document at position > 2: n - 3 per document
    assert c1 == c0 and c0["tokens_0"] == (7 - 3) + (9 - 3) + (12 - 3)
    assert l1 == pytest.approx(l0, rel=1e-6)
    for a, e in zip(g1, g0):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"\[2, 16\].*\[2, 8\]"):
        pad_batch(b, 2, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_equals_eager_over_batches_with_other_documents():
    d, head = drafter("cuda")
    bs = [batch(rows, seed=s).to("cuda") for s, rows in enumerate([[[64, 40, 24]], [[24, 24, 80]]])]
    ref = [loss_grads_counts(d, b, head) for b in bs]
    g = GraphedTTT(TTTUnroll(d, head, 3, 0.8, FAST))
    for i in (0, 1, 0):
        loss, _, counts = g.step(bs[i])
        assert counts["tokens_0"] == ref[i][2]["tokens_0"]
        assert float(loss) == pytest.approx(ref[i][0], rel=1e-4)
        for p, e in zip([p for p in d.parameters() if p.requires_grad], ref[i][1]):
            assert float((p.grad - e).norm()) <= 1e-3 * float(e.norm()) + 1e-6
    assert g.captures == 1
    assert ref[0][0] != pytest.approx(ref[1][0], rel=1e-3)  # the two batches really differ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_training_stage_with_graphs_matches_eager(tmp_path, monkeypatch):
    """train_drafter on a GPU, the default (graph replay: padded static batches, one capture)
    against ``train.backend.cuda_graphs: false`` (eager): same train losses, val metrics and weights to bf16
    precision over 6 optimizer steps."""
    from eyas.params.full import default_params
    from eyas.tracking.runs import Tracker
    from eyas.training.loop import new_drafter, train_drafter
    from eyas.vocab.mapping import build_mapping, count_tokens
    from tests.tiny import tiny_target, write_features

    target = tiny_target()
    train = write_features(target, tmp_path / "train", 24, seed=1)
    val = write_features(target, tmp_path / "val", 8, seed=2)
    head = target.head_weights()
    ids, mask = train.token_stats()
    mapping, _ = build_mapping(count_tokens(ids, mask, train.manifest["vocab_size"]), 64)
    captures = []
    real_capture = GraphedTTT._capture
    monkeypatch.setattr(GraphedTTT, "_capture",
                        lambda self, b: (captures.append(tuple(b.input_ids.shape)), real_capture(self, b))[1])
    runs = {}
    for mode in (True, False):
        d = new_drafter(train.manifest, mapping, head["embed_tokens"], seed=0)
        # attention auto: the tiny target's head_dim (8) is below flex attention's minimum
        tp = dataclasses.replace(default_params().train, ttt_length=3, step_decay=0.8, batch_tokens=128, epochs=1,
                                 warmup_ratio=0.0, grad_clip=1.0, eval_every=100, max_steps=6,
                                 backend=dataclasses.replace(FAST, attention="auto", cuda_graphs=mode))
        r = train_drafter(d, train_store=train, val_store=val, lm_head=head["lm_head"], tp=tp, lr=1e-3, seed=0,
                          tracker=Tracker(), device=torch.device("cuda"))
        runs[mode] = ([c["loss"] for c in r.curve if c["split"] == "train"], r.final_val,
                      torch.cat([p.detach().float().flatten() for p in d.parameters() if p.requires_grad]))
    assert len(captures) == 1  # every batch padded to one static shape
    (l1, v1, w1), (l0, v0, w0) = runs[True], runs[False]
    assert len(l1) == len(l0) == 6
    for a, b in zip(l1, l0):
        assert a == pytest.approx(b, rel=2e-3)
    assert v1["loss_0"] == pytest.approx(v0["loss_0"], rel=2e-3)
    assert float((w1 - w0).norm()) <= 2e-3 * float(w0.norm())


class _Loader:
    """The two attributes and the method :func:`eyas.training.unroll.evaluate` reads of a loader."""

    def __init__(self, batches: list[Batch], rows: int, row_tokens: int):
        self.bs, self.rows_per_batch, self.row_tokens = batches, rows, row_tokens

    def batches(self, epoch, rank=0, world=1, even=True):
        return iter(self.bs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels run on CUDA only")
def test_validation_compiles_once_for_batches_of_every_length():
    """Val batches are as long as their longest row; padded to the loader's static shape, the
    compiled pieces compile once for four lengths (unpadded: a recompile per length, and past
    Dynamo's limit of 8 they ran eager for the training after), and the metrics equal the
    reference backend's."""
    from torch._dynamo.utils import counters

    from eyas.drafter.backend import REFERENCE
    from eyas.training.unroll import evaluate

    d, head = drafter("cuda")
    bs = [batch(rows, seed=s) for s, rows in enumerate([[[40, 20]], [[30, 42], [16]], [[70], [50, 38]], [[96]]])]
    graphs = []
    for n in (1, len(bs)):
        torch._dynamo.reset()
        counters.clear()
        got = evaluate(TTTUnroll(d, head, 3, 0.8, FAST), _Loader(bs[:n], 2, 100), "cuda")
        graphs.append(counters["stats"]["unique_graphs"])
    ref = evaluate(TTTUnroll(d, head, 3, 0.8, REFERENCE), _Loader(bs, 2, 100), "cuda")
    assert graphs[0] > 0 and graphs[1] == graphs[0]
    assert got["loss_0"] == pytest.approx(ref["loss_0"], rel=2e-3)
    assert got["loss_2"] == pytest.approx(ref["loss_2"], rel=2e-3)


# --- the clip in the fused optimizer step ---------------------------------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_in_step_equals_clip_then_step(device, max_norm):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(40, 24, generator=g), torch.randn(24, generator=g), torch.randn(3, 5, generator=g)]
    ours = [p.clone().to(device).requires_grad_() for p in init]
    ref = [p.clone().to(device).requires_grad_() for p in init]
    frozen = torch.zeros(4, device=device, requires_grad=True)  # no gradient: skipped, not updated

    def groups(ps, extra=()):  # two groups, as a trainer with decay / no-decay groups has
        return [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:] + list(extra), "weight_decay": 0.0}]

    opt = torch.optim.AdamW(groups(ours, [frozen]), lr=1e-2, fused=True)
    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    for _ in range(3):
        grads = [3 * torch.randn(p.shape, generator=g).to(device) for p in init]
        for p, q, gr in zip(ours, ref, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        by_hand = math.sqrt(sum(float(gr.double().square().sum()) for gr in grads))
        norm = clip_in_step(opt, max_norm)
        norm_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        assert norm.dtype == torch.float32 and norm.shape == ()
        assert float(norm) == pytest.approx(by_hand, rel=1e-6)
        assert float(norm) == pytest.approx(float(norm_ref), rel=1e-6)
        opt.step()
        opt_ref.step()
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)  # left clipped, as clip_grad_norm_ does
        if max_norm < by_hand:  # the clip acted: the gradients now have norm max_norm
            clipped = math.sqrt(sum(float(p.grad.double().square().sum()) for p in ours))
            assert clipped == pytest.approx(max_norm, rel=1e-5)
    assert frozen.abs().max() == 0


def test_clip_in_step_rejects_a_threshold_that_is_not_positive():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p], fused=True)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="max_norm must be > 0"):
            clip_in_step(opt, bad)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps), lambda ps: torch.optim.RMSprop(ps)])
def test_clip_in_step_rejects_an_optimizer_that_would_not_clip(make):
    """Non-fused AdamW would fail at step() with an assertion; RMSprop would silently not clip."""
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.full((3,), 100.0)
    with pytest.raises(ValueError, match="does not apply grad_scale"):
        clip_in_step(make([p]), 1.0)
