"""The decoding-modes table (eyas/eval/modes.py) on the tiny target: every row, each checked against runs
made here independently (greedy chain, seeded sampled runs, the tree's output against greedy),
and the bootstrap interval on hand-worked cases."""

import pytest
import torch

from eyas.eval.modes import bootstrap_ci, evaluate_modes, row_name
from eyas.eval.sampling import sampled_generate
from eyas.eval.speculative import speculative_generate
from tests.tiny import greedy_replies, tiny_target
from tests.tiny import trained_drafter as train_tiny_drafter

K = 3


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_target()
    prompts, outputs = greedy_replies(target, seed=4, n_prompts=2, max_new_tokens=16)
    yield target, prompts, outputs, train_tiny_drafter(target, prompts, outputs, K, steps=30)
    torch.set_num_threads(threads)


def _pooled(runs):
    steps = [c for r in runs for c in r["committed_per_step"]]
    return sum(steps) / len(steps)


def test_served_rows_equal_independent_runs(setup):
    target, prompts, outputs, drafter = setup
    kw = dict(max_new_tokens=16, stop_ids=[])
    out = evaluate_modes(target, drafter, prompts, num_draft_tokens=K, aux_layer_ids=None, temperatures=[0, 0.8],
                         top_p=0.9, seeds=[3, 4], tree_topk=2, tree_num_steps=3, tree_num_draft_tokens=6, **kw)
    rows = out["rows"]
    assert set(rows) == {"eagle/chain/T0", "ngram/chain/T0", "eagle/chain/T0.8", "ngram/chain/T0.8",
                         "eagle/tree/T0"}
    greedy = [speculative_generate(target, drafter, p, num_draft_tokens=K, aux_layer_ids=None, **kw) for p in prompts]
    assert [r["tokens"] for r in greedy] == outputs
    assert rows["eagle/chain/T0"]["accept_len"] == pytest.approx(_pooled(greedy))
    assert rows["eagle/chain/T0"]["accept_len"] > 1.2  # the trained drafter gets chains accepted
    assert rows["eagle/tree/T0"]["matches_greedy"] is True
    assert rows["eagle/tree/T0"]["tree_nodes"] == 5
    for s in (3, 4):  # each seed's value is that of runs seeded with it, made here
        runs = [sampled_generate(target, drafter, p, num_draft_tokens=K, aux_layer_ids=None, temperature=0.8,
                                 top_p=0.9, generator=torch.Generator().manual_seed(s), **kw) for p in prompts]
        assert rows["eagle/chain/T0.8"]["accept_len_per_seed"][str(s)] == pytest.approx(_pooled(runs))
    for v in rows.values():
        lo, hi = v["ci95"]
        assert 1.0 <= lo <= hi <= K + 1
    assert rows["eagle/chain/T0.8"]["num_runs"] == 4 and rows["eagle/chain/T0"]["num_runs"] == 2
    assert out["settings"]["seeds"] == [3, 4] and out["settings"]["tree"]["topk"] == 2
    with pytest.raises(ValueError, match="no prompts"):
        evaluate_modes(target, drafter, [], num_draft_tokens=K, aux_layer_ids=None, temperatures=[0], top_p=1.0,
                       seeds=[0], tree_topk=1, tree_num_steps=K, tree_num_draft_tokens=K + 1, **kw)
    with pytest.raises(ValueError, match="needs at least one seed"):
        evaluate_modes(target, drafter, prompts, num_draft_tokens=K, aux_layer_ids=None, temperatures=[1.0],
                       top_p=1.0, seeds=[], tree_topk=1, tree_num_steps=K, tree_num_draft_tokens=K + 1, **kw)


def test_bootstrap_ci_hand_worked():
    assert bootstrap_ci([[2, 2], [2]]) == [2.0, 2.0]        # every resample pools to 2
    lo, hi = bootstrap_ci([[1], [3]])                       # resamples pool to 1, 2 or 3
    assert (lo, hi) == (1.0, 3.0)
    assert bootstrap_ci([[], []]) is None
    assert row_name("eagle", "chain", 0.7) == "eagle/chain/T0.7" and row_name("ngram", "chain", 0.0) == "ngram/chain/T0"


def test_compare_shows_the_served_table(tmp_path, monkeypatch):
    """`eyas compare` (MLflow) and `eyas compare --metrics` (metrics dirs) both show every row
    of the decoding-modes table and the serving verdict; a speedup the eval flagged is marked."""
    import json

    from eyas.params.full import parse_params
    from eyas.tracking import compare, compare_dirs
    from eyas.tracking import runs as tracking

    root = tmp_path / "repo"
    root.mkdir()
    (root / "dvc.yaml").write_text("stages: {}\n")
    for var in ("MLFLOW_TRACKING_URI", "DVC_EXP_BASELINE_REV", "RANK", "EYAS_TRACKING", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DVC_ROOT", str(root))
    monkeypatch.setenv("DVC_EXP_NAME", "exp-s")
    monkeypatch.chdir(root)
    logged = {"eval-accept-len@scratch": {"chat/served/eagle/chain/T0.7/accept_len": 1.8,
                                          "chat/served/eagle/chain/T0.7/ci95_low": 1.5,
                                          "chat/served/eagle/chain/T0.7/ci95_high": 2.1,
                                          "chat/served/ngram/chain/T0.7/accept_len": 1.3, "chat/worth_serving": 0.0,
                                          "chat/engine/speedup": 17.29, "chat/engine/speedup_flagged": 1.0,
                                          "humaneval/engine/speedup": 0.8, "humaneval/engine/speedup_flagged": 0.0},
              "eval-accept-len@finetune": {"chat/served/eagle/tree/T0/accept_len": 2.5,
                                           "chat/served/ngram/chain/T0.7/accept_len": 1.3, "chat/worth_serving": 1.0,
                                           "humaneval/worth_serving": 0.99999999999}}
    for stage, metrics in logged.items():
        monkeypatch.setenv("DVC_STAGE", stage)
        with tracking.start_stage_run(stage, parse_params({})) as t:
            t.log_metrics(metrics)
    lines = compare.compare().splitlines()
    assert "| scratch chat served eagle/chain/T0.7 accept_len [95% CI] | 1.8 [1.5, 2.1] |" in lines
    assert "| finetune chat served eagle/tree/T0 accept_len [95% CI] | 2.5 |" in lines
    assert sum("served ngram/chain/T0.7" in line for line in lines) == 1
    assert "| n-gram floor chat served ngram/chain/T0.7 accept_len [95% CI] | 1.3 |" in lines
    assert "| scratch chat worth serving (beats the n-gram floor and greedy) | no |" in lines
    assert "| finetune chat worth serving (beats the n-gram floor and greedy) | yes |" in lines
    # a value that is not 1 / 0 is shown as it is, never as a verdict; an eval run that logged no
    # verdict (unknown) says so, and "–" stays for a stage with no run
    assert "| finetune humaneval worth serving (beats the n-gram floor and greedy) | 0.99999999999 (not 0/1) |" in lines
    assert "| scratch humaneval worth serving (beats the n-gram floor and greedy) | not logged |" in lines
    assert "| scratch chat speedup in llama.cpp (same-precision target) | 17.29 (flagged) |" in lines
    assert "| scratch humaneval speedup in llama.cpp (same-precision target) | 0.8 |" in lines  # logged unflagged

    d = tmp_path / "metrics"
    d.mkdir()
    table = {"rows": {"eagle/chain/T1": {"accept_len": 1.7, "ci95": [1.4, 2.0]},
                      "ngram/chain/T1": {"accept_len": 1.2, "ci95": None}}}
    (d / "eval_scratch.json").write_text(json.dumps({"served": {"humaneval": table},
                                                     "chat": {"serving_verdict": {"worth_serving": False}}}))
    (d / "params.yaml").write_text("train:\n  loss_tokens: assistant\n")  # the run's own params (a preset's)
    lines = compare_dirs.compare_dirs([str(d)]).splitlines()
    assert "| `train.loss_tokens` | assistant |" in lines  # which tokens the run supervised
    assert "| scratch humaneval served eagle/chain/T1 accept_len [95% CI] | 1.7 [1.4, 2] |" in lines
    assert "| n-gram floor humaneval served ngram/chain/T1 accept_len [95% CI] | 1.2 |" in lines
    assert "| scratch chat worth serving (beats the n-gram floor and greedy) | no |" in lines
