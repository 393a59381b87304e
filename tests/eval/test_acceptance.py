"""eyas.eval.acceptance: timing a subset and taking the rest from batched greedy + the exact oracle
reports the same acceptance as decoding every prompt for real."""

from __future__ import annotations

import torch

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.eval.acceptance import evaluate_benchmark, k_sweep
from tests.tiny import VOCAB, tiny_target

DECODING = ("accept_len", "accept_len_per_prompt_mean", "per_position_accept_rate", "accepted_histogram",
            "num_prompts", "num_verify_steps", "new_tokens", "accept_len_by_chain_length", "repetition")


def test_a_timed_subset_reports_what_decoding_every_prompt_reports():
    t = tiny_target()
    torch.manual_seed(3)
    d = Eagle3Drafter(DrafterConfig.for_target(t.model.config, draft_vocab_size=VOCAB)).eval()
    d.set_embedding(t.model.get_input_embeddings().weight)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7)]
    kw = dict(num_draft_tokens=3, max_new_tokens=12, stop_ids=[], aux_layer_ids=d.config.resolved_aux_layers(),
              timing_repeats=1, batch_size=2)
    full, full_ngram = evaluate_benchmark(t, d, prompts, timed_prompts=0, **kw)
    part, part_ngram = evaluate_benchmark(t, d, prompts, timed_prompts=2, **kw)
    assert full["settings"]["timed_prompts"] == 5 and part["settings"]["timed_prompts"] == 2
    assert full["oracle_matches_real"] is True and part["oracle_matches_real"] is True
    assert full["lossless"] and part["lossless"] and part["real_run"]["num_prompts"] == 2
    for key in DECODING:
        assert part[key] == full[key], key
        assert part_ngram[key] == full_ngram[key], key
    # the oracle over all prompts equals the real runs over all prompts
    assert full["accept_len"] == full["real_run"]["accept_len"]
    assert full["num_prompts"] == 5 and full["new_tokens"] == 5 * 12
    # the subset's own real acceptance is reported apart, and is not the all-prompt figure
    assert part["real_run"]["num_verify_steps"] < part["num_verify_steps"]


def test_k_sweep_predicts_from_measured_step_costs():
    m = {"accept_len_by_chain_length": {"1": 1.5, "2": 1.8, "3": 1.9, "4": 1.95},
         "timing": {"step_ms": {"plain_decode": 10.0, "target_verify": 11.0, "drafter": 4.0}}}
    s = k_sweep(m)
    # j=1: 1.5*10/(11+1) = 1.25; j=2: 1.8*10/13 = 1.3846; j=3: 19/14 = 1.357; j=4: 19.5/15 = 1.3
    assert s["recommended_k"] == 2
    assert abs(s["predicted_speedup"]["2"] - 18 / 13) < 1e-12 and abs(s["predicted_speedup"]["4"] - 1.3) < 1e-12
    assert k_sweep({**m, "timing": None}) == {"predicted_speedup": {j: None for j in "1234"}, "recommended_k": None}
