"""Speculative sampling is lossless in distribution: on a tiny target, the first generated tokens
over many seeds follow the target's own sampling distribution (computed independently by
enumerating every prefix with plain forwards), for the EAGLE drafter and the n-gram floor; and
the same check catches a wrong accept rule (accept always; resample from p instead of the
residual)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from scipy.stats import chi2

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.eval import sampling
from eyas.eval.sampling import sampled_generate, target_probs, verify_chain_sampled
from eyas.eval.speculative import NgramProposer

V, DRAFT_V = 16, 10
PROMPT = [3, 7, 1, 3, 7, 2, 5, 3, 7]  # "3 7" recurs: the n-gram floor drafts from the first step
N_TOKENS, K = 3, 2                     # y1 from the prefill, y2 and y3 from the first verify step
TEMPERATURE, TOP_P = 1.0, 0.95
SEEDS = 600


@pytest.fixture(scope="module")
def target():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.lm_head.weight.data *= 20.0  # a few likely tokens per position, not a uniform spread
    yield model
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    # explicit aux ids: the default [2, L//2, L-3] is no valid id set on 2 layers
    d = Eagle3Drafter(DrafterConfig.for_target(target.config, draft_vocab_size=DRAFT_V, aux_layer_ids=[1, 2])).eval()
    d.set_embedding(target.get_input_embeddings().weight)
    d.lm_head.weight.data *= 20.0  # a confident drafter that is often wrong: every branch of the rule runs
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(2))[:DRAFT_V].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab(ids - torch.arange(DRAFT_V), t2d)  # 6 target ids are outside the draft vocab
    return d


@torch.no_grad()
def exact_distribution(model) -> dict[tuple, float]:
    """P(y1..yN | PROMPT) under the target sampled at TEMPERATURE / TOP_P, by enumeration: every
    prefix of the support, one uncached forward each (independent of the speculative code)."""
    dist = {(): 1.0}
    for _ in range(N_TOKENS):
        prefixes = list(dist)
        logits = model(input_ids=torch.tensor([PROMPT + list(s) for s in prefixes])).logits[:, -1]
        probs = target_probs(logits, TEMPERATURE, TOP_P)
        dist = {s + (t,): dist[s] * float(probs[i, t])
                for i, s in enumerate(prefixes) for t in range(V) if probs[i, t] > 0}
    return dist


def empirical(model, proposer_factory, seeds: int) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    for seed in range(seeds):
        out = sampled_generate(model, proposer_factory(), PROMPT, num_draft_tokens=K, max_new_tokens=N_TOKENS,
                               stop_ids=[], aux_layer_ids=None, temperature=TEMPERATURE, top_p=TOP_P,
                               generator=torch.Generator().manual_seed(seed))
        key = tuple(out["tokens"])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square(counts: dict[tuple, int], exact: dict[tuple, float]) -> tuple[float, int, float]:
    """Pearson's chi-square of the counts against the exact distribution, outcomes with an expected
    count below 5 pooled into one bin (outcomes outside the support land there too) -> (statistic,
    degrees of freedom, p-value)."""
    n = sum(counts.values())
    big = [s for s, p in exact.items() if n * p >= 5]
    obs = [counts.get(s, 0) for s in big]
    exp = [n * exact[s] for s in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_obs:  # mass where the target has none
        return math.inf, len(obs) - 1, 0.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(obs) - 1, float(chi2.sf(stat, len(obs) - 1))


def total_variation(counts: dict[tuple, int], exact: dict[tuple, float]) -> float:
    n = sum(counts.values())
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(s, 0) / n - exact.get(s, 0.0)) for s in keys)


def _report(name, counts, exact):
    stat, dof, pval = chi_square(counts, exact)
    tv = total_variation(counts, exact)
    print(f"\n{name}: chi-square {stat:.1f} on {dof} dof, p = {pval:.3g}; TV {tv:.4f} "
          f"over {sum(counts.values())} seeds")
    return pval, tv


def _accept_always(draft_tokens, draft_probs, probs, stop_ids, generator):
    """WRONG: every draft accepted, bonus from p_k."""
    return len(draft_tokens), list(draft_tokens) + [sampling._sample(probs[len(draft_tokens)], generator)]


def _resample_from_p(draft_tokens, draft_probs, probs, stop_ids, generator):
    """WRONG: the correct accept test, but a rejection resamples from p instead of the residual."""
    committed = []
    for i, x in enumerate(draft_tokens):
        qx = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if qx > 0 and float(torch.rand((), generator=generator)) * qx < float(probs[i, x]):
            committed.append(x)
            continue
        return i, committed + [sampling._sample(probs[i], generator)]
    return len(draft_tokens), committed + [sampling._sample(probs[-1], generator)]


class TargetArgmaxProposer:
    """Drafts the target's own greedy continuation (plain uncached forwards), a deterministic
    proposer (point-mass q) whose drafts the target often accepts: a rule that mishandles
    rejections (resampling from p instead of the residual) shows at once."""

    needs_features = False

    def __init__(self, model):
        self.model = model

    def prefill(self, tokens, features):
        self.tokens = list(tokens)

    @torch.no_grad()
    def propose(self, k):
        ext = list(self.tokens)
        for _ in range(k):
            ext.append(int(self.model(input_ids=torch.tensor([ext])).logits[0, -1].argmax()))
        return ext[len(self.tokens):]

    def accept(self, committed, features):
        self.tokens.extend(committed)


PROPOSERS = {"eagle": lambda m, d: (lambda: d), "ngram": lambda m, d: NgramProposer,
             "target-argmax": lambda m, d: (lambda: TargetArgmaxProposer(m))}


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["eagle", "ngram", "target-argmax"])
def test_sampled_output_follows_the_target_distribution(target, drafter, proposer):
    exact = exact_distribution(target)
    assert abs(sum(exact.values()) - 1) < 1e-5
    counts = empirical(target, PROPOSERS[proposer](target, drafter), SEEDS)
    pval, tv = _report(f"{proposer}, standard rule", counts, exact)
    assert pval > 1e-3  # TV is reported, not bounded: over this many outcomes its sampling noise dominates


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule, proposer", [(_accept_always, "eagle"), (_resample_from_p, "target-argmax")])
def test_a_wrong_rule_is_detected(target, drafter, wrong_rule, proposer, monkeypatch):
    """The check above has the power to fail: the same setup with a wrong rule is rejected."""
    monkeypatch.setattr(sampling, "verify_chain_sampled", wrong_rule)
    exact = exact_distribution(target)
    counts = empirical(target, PROPOSERS[proposer](target, drafter), SEEDS)
    pval, tv = _report(f"{proposer}, {wrong_rule.__name__}", counts, exact)
    assert pval < 1e-6


def test_rule_hand_worked():
    """Point mass on an impossible token: always rejected, resampled from p without it; a
    proposal equal to p: always accepted; q zero where p is not: the residual covers it."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for _ in range(50):
        acc, com = verify_chain_sampled([0], None, p, [], g)
        assert acc == 0 and len(com) == 1 and com[0] in (1, 2)
        acc, com = verify_chain_sampled([1], p[:1], p, [], g)
        assert acc == 1 and com[0] == 1 and len(com) == 2
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # all q mass on 1: accepted w.p. p(1)/q(1) = 0.5
    seen = [verify_chain_sampled([1], q, p, [], g)[1][0] for _ in range(2000)]
    assert abs(seen.count(1) / 2000 - 0.5) < 0.05 and seen.count(0) == seen.count(3) == 0
    assert abs(seen.count(2) / 2000 - 0.5) < 0.05   # the residual max(p - q, 0) is all on 2
    acc, com = verify_chain_sampled([1], p[:1], p, [1], g)
    assert (acc, com) == (1, [1])  # an accepted stop token: no bonus
    with pytest.raises(ValueError, match="2 target rows"):
        verify_chain_sampled([1], None, p[:1], [], g)
    with pytest.raises(ValueError, match="temperature"):
        target_probs(torch.zeros(4), 0.0, 1.0)
    with pytest.raises(ValueError, match="top_p"):
        target_probs(torch.zeros(4), 1.0, 0.0)


def test_seed_reproduces_a_run(target, drafter):
    runs = [sampled_generate(target, drafter, PROMPT, num_draft_tokens=3, max_new_tokens=12, stop_ids=[],
                             aux_layer_ids=None, temperature=0.7, top_p=0.9,
                             generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert len(runs[0]["tokens"]) == 12 == 1 + sum(runs[0]["committed_per_step"])
