"""TTT alignment, golden by hand: inputs, teacher, reference and mask shift together (ttt.py's
docstring), the same-document rule for packed rows, and the chain semantic of ``ttt_step`` checked
against the drafter's incremental ``decode`` with a KV cache."""

import math

import pytest
import torch

from eyas.drafter.backend import REFERENCE
from eyas.drafter.model import DrafterConfig, Eagle3Drafter, KVCache
from eyas.training.batches import Batch, pad_batch, shift_left, supervised
from eyas.training.unroll import ttt_forward

V, H = 64, 32


def make_drafter(seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    c = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=V, draft_vocab_size=V, target_hidden_size=H, num_target_layers=8)
    d = Eagle3Drafter(c).eval()
    d.reset_parameters(std=0.3)  # larger weights: attention patterns matter in the comparisons
    d.set_embedding(torch.randn(V, H))
    d.set_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    return d


#                  t: 0  1  2  3  4 | 5  6  7     (two packed documents in one row)
DOCS = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
POS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
LOSS_MASK = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
X = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
# supervised positions t at step k: loss_mask[t+2+k] and doc[t] == doc[t+2+k]
#   k=0: t=0 (lm[2]=1), t=1 (lm[3]), t=2 (lm[4]); t=3: lm[5]=0; t=4: lm[6]=1 but doc 0 vs 1; t=5: lm[7]
#   k=1: t=0 (lm[3]), t=1 (lm[4]); t=2: lm[5]=0; t=3, 4: lm[6], lm[7] in doc 1
#   k=2: t=0 (lm[4]); t=1: lm[5]=0; t=2, 3: doc 1
SUPERVISED = {0: [0, 1, 2, 5], 1: [0, 1], 2: [0]}


def make_batch(target_argmax=None, seed=1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(input_ids=X.clone(), loss_mask=LOSS_MASK.clone(),
                 aux_hidden=torch.randn(1, 8, 3 * H, generator=g), final_hidden=torch.randn(1, 8, H, generator=g),
                 target_argmax=torch.randint(0, V, (1, 8), generator=g) if target_argmax is None else target_argmax,
                 positions=POS.clone(), doc_ids=DOCS.clone(), sample_ids=[(0, 0), (0, 1)])


def test_shift_left_by_hand():
    x = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    assert shift_left(x, 0, 0).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert shift_left(x, 1, 0).tolist() == [[2, 3, 4, 5, 6, 7, 8, 0]]
    assert shift_left(x, 2, -1).tolist() == [[3, 4, 5, 6, 7, 8, -1, -1]]
    m = torch.tensor([[True, False, True]])
    assert shift_left(m, 1, False).tolist() == [[False, True, False]]
    h = torch.arange(6.).view(1, 3, 2)
    assert shift_left(h, 1, 0.0).tolist() == [[[2., 3.], [4., 5.], [0., 0.]]]


def _capture(drafter, monkeypatch):
    calls = []
    real = drafter.ttt_step

    def spy(hidden, input_ids, positions, doc_ids, cache, weights=None, backend=REFERENCE):
        out = real(hidden, input_ids, positions, doc_ids, cache, weights, backend)
        calls.append({"hidden": hidden.detach().clone(), "input_ids": input_ids.clone(),
                      "positions": positions.clone(), "doc_ids": doc_ids.clone(), "out": out.detach().clone()})
        return out

    monkeypatch.setattr(drafter, "ttt_step", spy)
    return calls


def test_inputs_teacher_reference_and_mask_shift_together(monkeypatch):
    d = make_drafter()
    head = torch.randn(V, H) * 0.5
    # first pass: learn what the drafter predicts at each index, then build a reference by hand
    calls = _capture(d, monkeypatch)
    with torch.no_grad():
        ttt_forward(d, make_batch(), head, ttt_length=3, step_decay=0.8)
    pred0 = d.logits(calls[0]["out"]).argmax(-1)[0]  # draft ids == target ids (identity map)
    # reference at step 0 is target_argmax[t+1]: make t=0 and t=5 correct (supervised), t=2 wrong,
    # and t=3, t=4 correct but UNSUPERVISED (a mask off by one or two would count them)
    ref = torch.full((1, 8), V - 1)
    for t in (0, 5, 3, 4):
        ref[0, t + 1] = pred0[t]
    ref[0, 1 + 1] = (pred0[1] + 1) % V
    ref[0, 2 + 1] = (pred0[2] + 1) % V
    calls.clear()
    batch = make_batch(target_argmax=ref)
    with torch.no_grad():
        total, metrics, counts = ttt_forward(d, batch, head, ttt_length=3, step_decay=0.8)

    assert len(calls) == 3
    for k, call in enumerate(calls):
        # embedding input at step k is x[t+1+k] (zero-padded past the row)
        expect_ids = [X[0, t + 1 + k].item() if t + 1 + k < 8 else 0 for t in range(8)]
        assert call["input_ids"][0].tolist() == expect_ids, k
        assert torch.equal(call["positions"], POS + k)
        assert torch.equal(call["doc_ids"], DOCS)
        # hidden input: fc(aux) at step 0, the previous step's pre-norm output afterwards
        prev = d.fc(batch.aux_hidden) if k == 0 else calls[k - 1]["out"]
        assert torch.allclose(call["hidden"], prev.detach(), atol=1e-6), k

    # which positions count
    for k, ts in SUPERVISED.items():
        assert counts[f"tokens_{k}"] == len(ts), k

    # teacher at step k is the target distribution at t+1+k; loss is the mean over supervised t
    p_all = torch.matmul(batch.final_hidden, head.T).softmax(-1)[0]
    losses = []
    for k, ts in SUPERVISED.items():
        with torch.no_grad():
            logp = d.logits(calls[k]["out"]).float().log_softmax(-1)[0]
        expect = torch.stack([-(p_all[t + 1 + k] * logp[t]).sum() for t in ts]).mean()
        assert metrics[f"loss_{k}"] == pytest.approx(float(expect.detach()), rel=1e-5), k
        losses.append(expect)
    assert float(total.detach()) == pytest.approx(float(losses[0] + 0.8 * losses[1] + 0.64 * losses[2]), rel=1e-5)

    # reference: step 0 correct at t = 0 and 5 of {0, 1, 2, 5}
    assert counts["correct_0"] == 2
    assert metrics["acc_0"] == pytest.approx(0.5)


def test_loss_tokens_all_supervises_every_token_of_each_document():
    """train.loss_tokens: 'all' supervises t whenever t+2+k lies in t's document, prompt tokens
    included, and its loss is the loss of the same batch extracted with an all-ones mask. By hand
    for DOCS (lengths 5 and 3) with only t = 4 and 7 assistant tokens: 'all' k=0 -> t in 0,1,2 and 5;
    k=1 -> 0,1; k=2 -> 0. 'assistant' k=0 -> t = 2 (predicts 4) and 5 (7); k=1 -> 1; k=2 -> 0."""
    d = make_drafter()
    b = make_batch()
    b.loss_mask = torch.tensor([[0, 0, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(3))
    _, _, c_asst = ttt_forward(d, supervised(b, "assistant"), head, 3, 0.8, backend=REFERENCE)
    loss_all, _, c_all = ttt_forward(d, supervised(b, "all"), head, 3, 0.8, backend=REFERENCE)
    ones = make_batch()
    ones.loss_mask = torch.ones_like(ones.loss_mask)
    loss_ones, _, _ = ttt_forward(d, ones, head, 3, 0.8, backend=REFERENCE)
    assert [c_all[f"tokens_{k}"] for k in range(3)] == [4, 2, 1]
    # padding (doc id -1) stays unsupervised: the same counts and loss in a [2, 16] padded batch
    _, _, c_pad = ttt_forward(d, supervised(pad_batch(b, 2, 16), "all"), head, 3, 0.8, backend=REFERENCE)
    assert [c_pad[f"tokens_{k}"] for k in range(3)] == [4, 2, 1]
    assert [c_asst[f"tokens_{k}"] for k in range(3)] == [2, 1, 1]
    assert float(loss_all) == pytest.approx(float(loss_ones), rel=1e-6)
    assert supervised(b, "assistant") is b and int(b.loss_mask.sum()) == 2  # the extracted mask untouched
    with pytest.raises(ValueError, match="train.loss_tokens.*'prompt'"):
        supervised(b, "prompt")


def test_step1_reference_is_target_argmax_at_t_plus_2(monkeypatch):
    d = make_drafter(seed=3)
    head = torch.randn(V, H) * 0.5
    calls = _capture(d, monkeypatch)
    with torch.no_grad():
        ttt_forward(d, make_batch(), head, ttt_length=2, step_decay=1.0)
    pred1 = d.logits(calls[1]["out"]).argmax(-1)[0]
    ref = torch.full((1, 8), V - 1)
    ref[0, 0 + 2] = pred1[0]            # supervised t=0 correct
    ref[0, 1 + 2] = (pred1[1] + 1) % V  # supervised t=1 wrong
    ref[0, 3 + 1] = pred1[3]  # an off-by-one reference (t+1) at t=3 must not count
    calls.clear()
    with torch.no_grad():
        _, metrics, counts = ttt_forward(d, make_batch(target_argmax=ref), head, ttt_length=2, step_decay=1.0)
    assert counts["tokens_1"] == 2 and counts["correct_1"] == 1
    assert metrics["acc_1"] == pytest.approx(0.5)


def test_ttt_steps_equal_incremental_decode():
    """Chain semantic: at step 1 the query at index t attends to step-0 keys <= t and its own step-1
    key; at step 2 also its step-2 key. That is exactly a chain draft decoded with a KV cache."""
    d = make_drafter(seed=5)
    T = 6
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(1, T, 3 * H, generator=g)
    x = torch.randint(0, V, (1, T), generator=g)
    pos = torch.arange(T)[None]
    docs = torch.zeros(1, T, dtype=torch.int64)
    with torch.no_grad():
        cache: list = []
        h0 = d.ttt_step(d.fc(aux), shift_left(x, 1, 0), pos, docs, cache)
        h1 = d.ttt_step(h0, shift_left(x, 2, 0), pos + 1, docs, cache)
        h2 = d.ttt_step(h1, shift_left(x, 3, 0), pos + 2, docs, cache)

        kv = KVCache()
        d0 = d.decode(aux, shift_left(x, 1, 0), pos, kv)  # fc applied: 3H-wide input
        assert torch.allclose(d0, h0, atol=1e-5), (d0 - h0).abs().max()
        ids1, ids2 = shift_left(x, 2, 0), shift_left(x, 3, 0)
        k0, v0 = kv.k.clone(), kv.v.clone()
        for t in range(T):
            kv.k, kv.v = k0[:, :, :t + 1], v0[:, :, :t + 1]  # the prefix: step-0 keys 0..t
            o1 = d.decode(h0[:, t:t + 1], ids1[:, t:t + 1], pos[:, t:t + 1] + 1, kv)
            assert torch.allclose(o1[0, 0], h1[0, t], atol=1e-5), (t, (o1[0, 0] - h1[0, t]).abs().max())
            o2 = d.decode(h1[:, t:t + 1], ids2[:, t:t + 1], pos[:, t:t + 1] + 2, kv)
            assert torch.allclose(o2[0, 0], h2[0, t], atol=1e-5), (t, (o2[0, 0] - h2[0, t]).abs().max())
        # the comparison is not vacuous: step 1 differs from re-running step 0's attention
        assert not torch.allclose(h1, h0, atol=1e-3)


def _dense_ttt_attention(q, ks, vs, doc):
    """TTT attention written out: softmax over [step-0 keys (causal, same document) | the
    query's own index in steps 1..n], GQA by repeating kv heads."""
    rep, hd, T = q.shape[1] // ks[0].shape[1], q.shape[-1], q.shape[2]
    k0, v0 = (t.repeat_interleave(rep, dim=1) for t in (ks[0], vs[0]))
    s0 = q @ k0.transpose(-1, -2) / math.sqrt(hd)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & (doc[:, :, None] == doc[:, None, :])
    s0 = s0.masked_fill(~allowed[:, None], float("-inf"))
    diag = [(q * k.repeat_interleave(rep, dim=1)).sum(-1, keepdim=True) / math.sqrt(hd) for k in ks[1:]]
    p = torch.cat([s0, *diag], dim=-1).softmax(-1)
    o = p[..., :T] @ v0
    for j, v in enumerate(vs[1:]):
        o = o + p[..., T + j:T + j + 1] * v.repeat_interleave(rep, dim=1)
    return o, s0.logsumexp(-1), p[..., :T] @ v0 / p[..., :T].sum(-1, keepdim=True)


def test_flex_ttt_attention_equals_dense_softmax():
    """The CUDA path's attention (flex over step-0 keys, then merge_diagonal through the
    log-sum-exp) equals one softmax over all allowed keys: forward through eager flex_attention
    on CPU (no backward there), and merge_diagonal's gradients from a dense step-0 part."""
    from eyas.drafter.attention import flex_ttt_attention, merge_diagonal

    eager = REFERENCE  # nothing compiled: eager flex_attention on CPU
    g = torch.Generator().manual_seed(0)
    B, nh, nkv, T, hd = 2, 4, 2, 128, 8
    q = torch.randn(B, nh, T, hd, generator=g, requires_grad=True)
    ks = [torch.randn(B, nkv, T, hd, generator=g, requires_grad=True) for _ in range(3)]
    vs = [torch.randn(B, nkv, T, hd, generator=g, requires_grad=True) for _ in range(3)]
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 50:], doc[1, 100:] = 1, -1  # two documents; padding (doc -1) attends to itself
    ref, lse0, o0 = _dense_ttt_attention(q, ks, vs, doc)
    with torch.no_grad():
        for n in (1, 3):  # step 0 alone, and step 2 (two diagonal keys)
            out = flex_ttt_attention(q.detach(), [(k.detach(), v.detach()) for k, v in zip(ks[:n], vs[:n])], doc,
                                     eager)
            want = _dense_ttt_attention(q, ks[:n], vs[:n], doc)[0]
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    pad = [torch.zeros_like(ks[0])] * 3  # two real diagonal keys, three padding entries never seen
    merged = merge_diagonal(q, o0, lse0, torch.stack(ks[1:] + pad, dim=3), torch.stack(vs[1:] + pad, dim=3),
                            torch.arange(5) < 2)
    torch.testing.assert_close(merged, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn(ref.shape, generator=g)
    got = torch.autograd.grad((merged * w).sum(), [q, *ks, *vs], retain_graph=True)
    want = torch.autograd.grad((ref * w).sum(), [q, *ks, *vs])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_unroll_module_holds_only_the_drafter_weights():
    """TTTUnroll's parameters and state are the drafter's under a ``drafter.`` prefix (what DDP
    and FSDP wrap and eyas/training/distributed.py strips); the teacher rows are neither; its forward is
    the computation ttt_forward reads back."""
    from eyas.training.batches import counts_from_stats
    from eyas.training.unroll import TTTUnroll

    d, batch = make_drafter(), make_batch()
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(4))
    u = TTTUnroll(d, head, ttt_length=3, step_decay=0.8)
    assert [n for n, _ in u.named_parameters()] == [f"drafter.{n}" for n, _ in d.named_parameters()]
    assert list(u.state_dict()) == [f"drafter.{k}" for k in d.state_dict()]
    loss, stats = u(batch)
    assert stats.shape == (3, 6) and stats.dtype == torch.float64 and loss.requires_grad
    total, _, counts = ttt_forward(d, batch, head, ttt_length=3, step_decay=0.8)
    assert torch.equal(loss, total) and counts_from_stats(stats) == counts
    assert counts["tokens_0"] == float(stats[0, 0]) > 0
