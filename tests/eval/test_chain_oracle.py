"""The chain-length oracle (eyas/eval/oracle.py): the walk and the loop rule on hand-worked
cases, and exactness against real speculative decoding for every chain length 1..k on the tiny
target (an EAGLE drafter trained on the target's own greedy outputs, and n-gram lookup)."""

import math

import pytest
import torch

from eyas.eval.oracle import (
    accepted_draft_counts,
    chain_acceptance_length,
    chain_report,
    chain_walk,
    repetition_loop_period,
    walk_metrics,
)
from eyas.eval.speculative import NgramProposer, evaluate_prompts, greedy_generate, speculative_generate
from tests.tiny import VOCAB
from tests.tiny import trained_drafter as train_tiny_drafter

K = 4


# --- hand-worked ------------------------------------------------------------------------------

def test_chain_walk_hand_worked():
    counts = [9, 2, 0, 3, 3, 1, 0, 0]  # counts[0] is never read: y[0] comes from the prefill
    # j=3: p=1 accepts 2, commits 3 -> p=4 accepts 3, commits 4 -> p=8 (the end)
    assert chain_walk(counts, 8, 3) == [(2, 3), (3, 4)]
    assert chain_acceptance_length(counts, 8, 3) == (3.5, 2)
    # j=3 over 6 tokens: the step at p=4 would commit 4 but only 2 remain (max_new_tokens cut)
    assert chain_walk(counts, 6, 3) == [(2, 3), (2, 2)]
    assert chain_acceptance_length(counts, 6, 3) == (2.5, 2)
    # j=1: p=1 -> 3 -> 5 -> 7 (counts[7] = 0: the bonus only) -> 8
    assert chain_walk(counts, 8, 1) == [(1, 2), (1, 2), (1, 2), (0, 1)]
    assert chain_acceptance_length(counts, 8, 1) == (1.75, 4)
    al, steps = chain_acceptance_length(counts, 1, 2)
    assert math.isnan(al) and steps == 0
    with pytest.raises(ValueError, match="exceeds"):
        chain_walk(counts, 9, 2)
    with pytest.raises(ValueError, match="chain_length"):
        chain_walk(counts, 8, 0)


def test_bad_counts_and_mismatched_lists_are_refused():
    with pytest.raises(ValueError, match="counts must be >= 0"):
        chain_walk([0, -3, -3, 0], 4, 2)  # would walk backwards forever
    with pytest.raises(ValueError, match="2 count lists for 1 outputs"):
        walk_metrics([[0, 1], [0, 1]], [[5, 6]], 2)


def test_repetition_loop_period_hand_worked():
    assert repetition_loop_period([5] * 16) == 1
    assert repetition_loop_period([5] * 15) is None            # periodic, but shorter than 16
    assert repetition_loop_period([9] + [1, 2, 3] * 6) == 3    # tail of 18 periodic with P = 3
    assert repetition_loop_period([1, 2, 3] * 5 + [1]) == 3    # 16 tokens, the last period partial
    assert repetition_loop_period([1, 2, 3] * 5) is None       # 15 tokens
    assert repetition_loop_period(list(range(8)) * 2) is None  # 16 tokens but only 2 periods
    assert repetition_loop_period(list(range(8)) * 3) == 8
    assert repetition_loop_period([1, 2, 3] * 6 + [0]) is None  # left the loop (EOS)
    assert repetition_loop_period(list(range(17)) * 3) is None  # period 17 > max_period
    assert repetition_loop_period([7] * 20) == 1                # the smallest period
    assert repetition_loop_period([1, 2] * 3, min_span=6) == 2


# --- exactness against real decoding ----------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tiny_greedy):
    return tiny_greedy


@pytest.fixture(scope="module")
def trained_drafter(setup):
    """A drafter trained briefly (TTT, 40 Adam steps) on the target's own greedy outputs, so that
    chains of every length get accepted and rejected."""
    return train_tiny_drafter(*setup, K)


def _assert_walks_equal_real(target, proposer, prompt, y, stop_ids=(), aux=None):
    counts = accepted_draft_counts(target, proposer, prompt, y, num_draft_tokens=K, aux_layer_ids=aux)
    assert len(counts) == len(y) and all(0 <= c <= K for c in counts)
    for j in range(1, K + 1):
        real = speculative_generate(target, proposer, prompt, num_draft_tokens=j, max_new_tokens=len(y),
                                    stop_ids=stop_ids, aux_layer_ids=aux)
        assert real["tokens"] == y
        steps = list(zip(real["accepted_per_step"], real["committed_per_step"]))
        assert chain_walk(counts, len(y), j) == steps, (j, counts)
        al, n = chain_acceptance_length(counts, len(y), j)
        assert n == real["num_verify_steps"] and al == (len(y) - 1) / n
    return counts


def test_eagle_oracle_equals_real_decoding_for_every_chain_length(setup, trained_drafter):
    target, prompts, outputs = setup
    counts = [c for p, y in zip(prompts, outputs)
              for c in _assert_walks_equal_real(target, trained_drafter, p, y)[1:]]
    one = prompts[0][:1]  # a one-token prompt: the drafter's first real index drafts y[1]
    _assert_walks_equal_real(target, trained_drafter, one, greedy_generate(target, one, max_new_tokens=20,
                                                                           stop_ids=[]))
    # the comparison is not vacuous: chains of every length 0..K were accepted somewhere
    assert set(counts) == set(range(K + 1)), counts


def test_oracle_on_the_decoders_own_features_equals_its_own_forward(setup, trained_drafter):
    target, prompts, outputs = setup
    for p, y in zip(prompts, outputs):
        run = speculative_generate(target, trained_drafter, p, num_draft_tokens=K, max_new_tokens=len(y),
                                   stop_ids=[], aux_layer_ids=None, return_features=True)
        assert run["tokens"] == y and run["features"].shape[1] == len(p) + len(y) - 1
        own = accepted_draft_counts(target, trained_drafter, p, y, num_draft_tokens=K, aux_layer_ids=None)
        reused = accepted_draft_counts(target, trained_drafter, p, y, num_draft_tokens=K, aux_layer_ids=None,
                                       features=run["features"])
        assert reused == own
        assert chain_walk(reused, len(y), K) == list(zip(run["accepted_per_step"], run["committed_per_step"]))
    with pytest.raises(ValueError, match="features cover"):
        accepted_draft_counts(target, trained_drafter, p, y, num_draft_tokens=K, aux_layer_ids=None,
                              features=run["features"][:, :-1])
    f = run["features"]
    for bad, match in ((f[0], "must be a float tensor"), (f.repeat(2, 1, 1), "must be a float tensor"),
                       (f[..., :-1], "must be a float tensor"), (f.long(), "must be a float tensor"),
                       (torch.full_like(f, float("nan")), "NaN or inf")):
        with pytest.raises(ValueError, match=match):
            accepted_draft_counts(target, trained_drafter, p, y, num_draft_tokens=K, aux_layer_ids=None,
                                  features=bad)


def test_ngram_oracle_equals_real_decoding_with_eos(setup):
    target, prompts, outputs = setup
    seen = set()
    for p, y in zip(prompts, outputs):
        rep = p + y  # a prompt whose continuation repeats text already in it
        free = greedy_generate(target, rep, max_new_tokens=40, stop_ids=[])
        seen.update(_assert_walks_equal_real(target, NgramProposer(), rep, free)[1:])
        eos = free[20]  # an EOS inside the output: the walk must stop where the decoder stops
        y_eos = greedy_generate(target, rep, max_new_tokens=40, stop_ids=[eos])
        assert y_eos[-1] == eos and len(y_eos) <= 21
        _assert_walks_equal_real(target, NgramProposer(), rep, y_eos, stop_ids=[eos])
        # a stop set: an id the output never holds and one it first holds at i >= 8
        i = next(i for i in range(8, 40) if free[i] not in free[:i])
        stop = sorted({free[i], next(t for t in range(VOCAB) if t not in free)})
        y_stop = greedy_generate(target, rep, max_new_tokens=40, stop_ids=stop)
        assert y_stop == free[: i + 1]
        _assert_walks_equal_real(target, NgramProposer(), rep, y_stop, stop_ids=stop)
    assert K in seen and 0 in seen, seen


def test_chain_report_matches_evaluate_prompts(setup, trained_drafter):
    target, prompts, outputs = setup
    kw = dict(num_draft_tokens=K, max_new_tokens=32, stop_ids=[], aux_layer_ids=None, baseline=outputs,
              timing_repeats=0)
    for proposer in (trained_drafter, NgramProposer()):
        real = evaluate_prompts(target, proposer, prompts, **kw)
        counts = [accepted_draft_counts(target, proposer, p, y, num_draft_tokens=K, aux_layer_ids=None)
                  for p, y in zip(prompts, outputs)]
        r = chain_report(counts, outputs, K, real)
        assert r["oracle_matches_real"] is True
        walked = walk_metrics(counts, outputs, K)  # every decoding metric the real run reports
        assert walked == {key: real[key] for key in walked}
        assert r["accept_len_by_chain_length"][str(K)] == real["accept_len"]
        assert list(r["accept_len_by_chain_length"]) == ["1", "2", "3", "4"]
        steps = [[chain_acceptance_length(c, len(y), j)[1] for c, y in zip(counts, outputs)]
                 for j in range(1, K + 1)]
        for j in range(1, K + 1):
            assert r["accept_len_by_chain_length"][str(j)] == 31 * 4 / sum(steps[j - 1])
        loops = [i for i, y in enumerate(outputs) if repetition_loop_period(y)]
        rest = [i for i in range(4) if i not in loops]
        rep = r["repetition"]
        assert rep["looping_prompts"] == len(loops) and rep["looping_prompt_indices"] == loops
        for key, group in (("accept_len_looping", loops), ("accept_len_non_looping", rest)):
            want = 31 * len(group) / sum(steps[K - 1][i] for i in group) if group else None
            assert rep[key] == want, key
        # the match flag can fail: a histogram that differs from the walk's
        wrong = dict(real, accepted_histogram=real["accepted_histogram"][::-1])
        assert chain_report(counts, outputs, K, wrong)["oracle_matches_real"] is False


def test_unsupported_proposer_and_bad_input(setup):
    target, prompts, outputs = setup

    class Other:
        needs_features = False

    with pytest.raises(TypeError, match="no exact oracle"):
        accepted_draft_counts(target, Other(), prompts[0], outputs[0], num_draft_tokens=2, aux_layer_ids=None)
    with pytest.raises(ValueError, match="empty prompt"):
        accepted_draft_counts(target, NgramProposer(), [], outputs[0], num_draft_tokens=2, aux_layer_ids=None)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        accepted_draft_counts(target, NgramProposer(), prompts[0], outputs[0], num_draft_tokens=0,
                              aux_layer_ids=None)


def test_accept_len_figure_plots_chain_lengths():
    from eyas.tracking import plots

    m = {"chat": {"accepted_histogram": [2, 1, 1], "per_position_accept_rate": [0.5, 0.25], "accept_len": 1.75,
                  "accept_len_by_chain_length": {"1": 1.5, "2": 1.75}},
         "ngram": {"chat": {"accepted_histogram": [3, 1, 0], "per_position_accept_rate": [0.25, 0.0],
                            "accept_len": 1.25, "accept_len_by_chain_length": {"1": 1.25, "2": 1.25}}}}
    fig = plots.accept_len_figure(m)
    assert len(fig.axes) == 3
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[2].get_lines()}
    assert lines == {"drafter": ([1, 2], [1.5, 1.75]), "n-gram": ([1, 2], [1.25, 1.25])}
    del m["chat"]["accept_len_by_chain_length"], m["ngram"]["chat"]["accept_len_by_chain_length"]
    assert len(plots.accept_len_figure(m).axes) == 2  # files written before the oracle: as before
