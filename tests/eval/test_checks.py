"""A weak drafter or a setup fault: eyas.eval.checks.misconfiguration against the drafter's own
training figures (eyas.eval.checks.training_figures), alone, through the eval's front door
(eyas.eval.evaluate.evaluate_drafter) and through the stage (stages/eval_accept_len.py `run`).

The Wilson bound is recomputed here from its closed form (Wilson 1927), not from scipy. The front-door
cases decode for real on the tiny target: an untrained drafter (it learned nothing, and validates so:
a weak drafter, not a fault) and a briefly trained one whose d2t is then shifted by one id (a setup
fault); each drafter's validation accuracy at position 0 is measured here, teacher-forced on the
target's greedy replies (eyas.training.unroll.ttt_forward), as training measures it.
Negative control: the old check flagged the untrained drafter as a suspected misconfiguration
(``test_the_stage_reads_the_training_figures`` fails there).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import stages.eval_accept_len as stage
from eyas.eval import checks
from eyas.eval.evaluate import EvalFiles, evaluate_drafter
from eyas.params.full import default_params
from eyas.pipeline.resume import Parts
from eyas.tracking.runs import Tracker
from eyas.training.batches import head_rows_for, pack
from eyas.training.unroll import ttt_forward
from tests.tiny import VOCAB, trained_drafter

K, MAX_NEW = 3, 32
SETTINGS = {"max_prompt_tokens": 0, "prompts_shortened": 0, "prompts_dropped_too_long": 0}
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
# the quick trial (presets/quick.yaml) as a user met it: metrics/train_scratch.json val.acc_0 and
# train_tokens, and the eval's chat benchmark: 29 verify steps, position 0 accepted once
QUICK_TRAINED = {"acc_0": 0.1875, "train_tokens": 14556}
QUICK_EVAL = {"accept_len": 30 / 29, "per_position_accept_rate": [1 / 29, 0.0, 0.0, 0.0], "num_verify_steps": 29}
# the default pipeline's scratch drafter (metrics/train_scratch.json) and its chat eval's verify steps
DEFAULT_TRAINED = {"acc_0": 0.5157179269328802, "train_tokens": 386664}
DEFAULT_STEPS = 280
OLD_LOW = ("accept_len 1.034 <= 1.1: typical of aux hidden-state capture off, a wrong/zeroed d2t or the wrong "
           "speculative algorithm (or of a drafter that learned nothing for these prompts)")


def wilson_upper(k: int, n: int) -> float:
    """The upper end of the Wilson score interval at 95% for k successes in n trials."""
    p, z2 = k / n, Z95 * Z95
    return (p + z2 / (2 * n) + Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))) / (1 + z2 / n)


def result(accepted: list[int], k: int = 4) -> dict:
    """The decoding keys of a chain result from its verify steps' accepted draft counts."""
    n = len(accepted)
    return {"accept_len": sum(a + 1 for a in accepted) / n, "num_verify_steps": n,
            "per_position_accept_rate": [sum(a > i for a in accepted) / n for i in range(k)]}


# --- the check alone ------------------------------------------------------------------------------

def test_the_quick_trial_is_a_weak_drafter_not_a_fault():
    r = result([1] + [0] * 28)
    assert r == pytest.approx(QUICK_EVAL)
    flag = checks.misconfiguration(r, QUICK_TRAINED)
    assert flag["suspected"] is False and flag["reasons"] == [] and flag["trained"] == QUICK_TRAINED
    upper = wilson_upper(1, 29)
    assert f"{upper:.3f}" == "0.172"
    assert flag["note"] == (
        "the drafter learned little: its own validation accuracy at position 0 was 0.188 after 14,556 training "
        f"tokens, and the eval's position-0 acceptance 0.034 over 29 verify steps (at most {upper:.3f} at 95% "
        "confidence; accept_len 1.034) is consistent with it: a weak drafter, not a setup fault (train on more data)")
    # without training figures (an imported drafter): today's flag, word for word
    assert checks.misconfiguration(r) == {"suspected": True, "reasons": [OLD_LOW], "note": None, "trained": None}


def test_far_below_its_training_is_suspected_with_both_figures():
    r = result([0] * 277 + [1, 1, 2])  # 3 of 280 steps accept position 0
    flag = checks.misconfiguration(r, DEFAULT_TRAINED)
    assert flag["suspected"] is True and flag["note"] is None
    assert flag["reasons"] == [
        f"training reached 0.516 at position 0 (validation, after 386,664 training tokens) but the eval's "
        f"position-0 acceptance 0.011 over 280 verify steps (at most {wilson_upper(3, 280):.3f} at 95% confidence; "
        f"accept_len 1.014) is under half of it: the drafter is not decoded as it was trained: check aux "
        f"hidden-state capture (the drafter's aux layers), the d2t and the speculative algorithm (or these prompts "
        f"are far from its training data)"]
    # acceptance the old thresholds pass (accept_len 1.25 > 1.1, rate 0.2 > 0.02) but far below 0.516: suspected
    mid = result([0] * 224 + [1] * 42 + [2] * 14)
    assert mid["accept_len"] == 1.25 and checks.misconfiguration(mid)["suspected"] is False
    assert checks.misconfiguration(mid, DEFAULT_TRAINED)["suspected"] is True
    # the default drafter's own eval (117 of 280 steps accept position 0): consistent, not low, nothing said
    healthy = result([0] * 163 + [1] * 56 + [2] * 30 + [3] * 8 + [4] * 23)
    assert healthy["per_position_accept_rate"][0] == pytest.approx(0.41785714285714287)
    assert checks.misconfiguration(healthy, DEFAULT_TRAINED) == {"suspected": False, "reasons": [], "note": None,
                                                                 "trained": DEFAULT_TRAINED}


def test_the_tolerance_is_half_of_acc_0_at_the_rates_upper_bound():
    trained, n = {"acc_0": 0.4, "train_tokens": 1000}, 100
    below = max(k for k in range(n + 1) if wilson_upper(k, n) < 0.2)  # the last count whose bound misses 0.2
    assert 0 < below < 20  # the bound, not the rate: 0.2 itself is 20 of 100
    assert checks.misconfiguration(result([1] * below + [0] * (n - below)), trained)["suspected"] is True
    assert checks.misconfiguration(result([1] * (below + 1) + [0] * (n - below - 1)), trained)["suspected"] is False


def test_training_figures_from_the_train_metrics():
    src = Path("metrics/train_scratch.json")
    assert checks.training_figures({"val": {"acc_0": 0.1875, "acc_1": 0.05}, "train_tokens": 14556}, src) == \
        QUICK_TRAINED
    assert checks.training_figures({"val": {}, "train_tokens": 10}, src) is None  # nothing validated
    assert checks.training_figures({"val": {"acc_0": float("nan")}, "train_tokens": 10}, src) is None
    for bad, key in (({"train_tokens": 10}, "'val'"), ({"val": {"acc_0": "high"}, "train_tokens": 10}, "'val.acc_0'"),
                     ({"val": {"acc_0": 0.3}}, "'train_tokens'"), ({"val": {"acc_0": 0.3}, "train_tokens": 1.5},
                                                                    "'train_tokens'")):
        with pytest.raises(ValueError, match=f"^metrics/train_scratch.json: {key} is "):
            checks.training_figures(bad, src)


# --- through the front door, decoding for real ----------------------------------------------------

def acc_0(target, drafter, prompts, outputs) -> float:
    """The drafter's teacher-forced accuracy at position 0 on the target's greedy replies (reply
    tokens only), as training's validation measures it."""
    rows = []
    for p, y in zip(prompts, outputs):
        ids = torch.tensor(p + y)
        with torch.no_grad():
            cap = target.capture(ids[None], torch.ones(1, len(ids), dtype=torch.int64), None)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(p):] = True
        rows.append([{"input_ids": ids, "loss_mask": mask, **{k: v[0] for k, v in cap.items()}}])
    head = head_rows_for(target.model.lm_head.weight.detach(), drafter)
    with torch.no_grad():
        return ttt_forward(drafter, pack(rows, list(range(len(rows)))), head, 1, 0.8)[1]["acc_0"]


def _params():
    p = default_params()
    return dataclasses.replace(
        p, eval=dataclasses.replace(p.eval, num_draft_tokens=K, max_new_tokens=MAX_NEW, timed_prompts=1,
                                    timing_repeats=1, batch_size=4, served_prompts=0),
        serve=dataclasses.replace(p.serve, engine="none"))


def _front_door(tmp_path, target, drafter, prompts, trained):
    files = EvalFiles(drafter=tmp_path / "models/x", drafter_gguf=tmp_path / "models/x.gguf",
                            target_gguf=tmp_path / "models/target_gguf", work=tmp_path / "work")
    logged: dict = {}
    metrics = evaluate_drafter("x", _params(), target, drafter, {"chat": (prompts, SETTINGS)},
                               Parts(tmp_path / "work/parts.json", {"test": tmp_path.name}), files, logged.update,
                               trained)
    return metrics["chat"], logged


def test_an_untrained_drafter_is_weak_and_a_wrong_d2t_is_a_fault(tiny_greedy, tmp_path, capsys):
    target, prompts, outputs = tiny_greedy
    # learned nothing, and its validation says so: a note, no warning
    untrained = trained_drafter(target, prompts, outputs, K, steps=0)
    trained = {"acc_0": acc_0(target, untrained, prompts, outputs), "train_tokens": 0}
    assert trained["acc_0"] == 0.0
    r, logged = _front_door(tmp_path / "weak", target, untrained, prompts, trained)
    steps = 4 * (MAX_NEW - 1)  # nothing accepted: a verify step per token after the prefill's
    assert r["accept_len"] == 1.0 and r["num_verify_steps"] == steps
    assert r["suspected_misconfiguration"]["suspected"] is False and logged["chat/suspected_misconfiguration"] == 0.0
    out = capsys.readouterr().out
    assert f"eval x chat: {r['suspected_misconfiguration']['note']}" in out and "WARNING accept_len" not in out
    assert r["suspected_misconfiguration"]["note"].startswith(
        "the drafter learned little: its own validation accuracy at position 0 was 0.000 after 0 training tokens, "
        f"and the eval's position-0 acceptance 0.000 over {steps} verify steps")
    assert checks.misconfiguration(r)["suspected"] is True  # the same result without its training figures

    # trained, then decoded with its d2t shifted by one: far below what it validated at
    drafter = trained_drafter(target, prompts, outputs, K, steps=30)
    trained = {"acc_0": acc_0(target, drafter, prompts, outputs), "train_tokens": 30 * sum(map(len, outputs))}
    r, _ = _front_door(tmp_path / "good", target, drafter, prompts, trained)
    assert r["suspected_misconfiguration"] == {"suspected": False, "reasons": [], "note": None, "trained": trained}
    assert r["per_position_accept_rate"][0] > trained["acc_0"] / 2
    ids = torch.arange(VOCAB)
    drafter.d2t.copy_(ids.roll(-1) - ids)  # a wrong d2t: draft id i proposes target id i + 1 (mod the vocab)
    r, logged = _front_door(tmp_path / "fault", target, drafter, prompts, trained)
    flag = r["suspected_misconfiguration"]
    n, hits = r["num_verify_steps"], round(r["per_position_accept_rate"][0] * r["num_verify_steps"])
    assert wilson_upper(hits, n) < trained["acc_0"] / 2 and flag["suspected"] is True
    assert flag["reasons"][0].startswith(f"training reached {trained['acc_0']:.3f} at position 0 (validation, after "
                                         f"{trained['train_tokens']:,} training tokens) but the eval's position-0 "
                                         f"acceptance {hits / n:.3f} over {n} verify steps")
    assert logged["chat/suspected_misconfiguration"] == 1.0
    assert f"eval x chat: WARNING {flag['reasons'][0]}" in capsys.readouterr().out


# --- through the stage --------------------------------------------------------------------------

class Recorder(Tracker):
    def __init__(self):
        self.metrics: dict[str, float] = {}

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)


def test_the_stage_reads_the_training_figures(tiny_greedy, tmp_path, monkeypatch, capsys):
    """stage.run with and without ``metrics/train_scratch.json``, and with a malformed one."""
    target, prompts, outputs = tiny_greedy
    monkeypatch.chdir(tmp_path)
    Path("data/conversations").mkdir(parents=True)
    Path("data/conversations/test.jsonl").write_text('{"id": "a", "messages": []}\n')
    Path("target").mkdir()
    Path("target/config.json").write_text("{}")
    Path("metrics").mkdir()
    p = _params()
    p = dataclasses.replace(p, target=dataclasses.replace(p.target, path="./target", gguf_file=None))
    drafter = trained_drafter(target, prompts, outputs, K, steps=0)
    benchmarks = {"chat": (prompts[:2], SETTINGS)}
    train = Path("metrics/train_scratch.json")
    train.write_text(json.dumps({"val": {"acc_0": acc_0(target, drafter, prompts[:2], outputs[:2])},
                                 "train_tokens": 0, "steps": 0}))

    metrics = stage.run("scratch", p, target, drafter, benchmarks, Recorder())
    flag = json.loads(Path("metrics/eval_scratch.json").read_text())["chat"]["suspected_misconfiguration"]
    assert flag == metrics["chat"]["suspected_misconfiguration"]
    assert flag["suspected"] is False and flag["trained"] == {"acc_0": 0.0, "train_tokens": 0}
    assert flag["note"].startswith("the drafter learned little") and "WARNING accept_len" not in capsys.readouterr().out

    train.unlink()  # an imported drafter: no training figures, today's flag
    metrics = stage.run("scratch", p, target, drafter, benchmarks, Recorder())
    assert metrics["chat"]["suspected_misconfiguration"]["suspected"] is True
    assert metrics["chat"]["suspected_misconfiguration"]["trained"] is None

    train.write_text(json.dumps({"val": {"acc_0": "n/a"}, "train_tokens": 0}))
    with pytest.raises(SystemExit, match="^eval-accept-len@scratch: metrics/train_scratch.json: 'val.acc_0' is"):
        stage.run("scratch", p, target, drafter, benchmarks, Recorder())


@pytest.mark.parametrize("k, n", [(1, 29), (3, 280), (0, 10), (10, 10), (117, 280)])
def test_the_wilson_bound_is_scipys(k, n):
    scipy_stats = pytest.importorskip("scipy.stats")  # an independent implementation (mlflow brings scipy)
    assert checks.wilson_upper(k, n, 0.95) == pytest.approx(
        scipy_stats.binomtest(k, n).proportion_ci(0.95, method="wilson").high, abs=1e-12)
    assert checks.wilson_upper(k, n, 0.95) == pytest.approx(wilson_upper(k, n), abs=1e-9)


# --- bad input: the training file and the eval's result, as a hostile user writes them -------------

def test_training_figures_out_of_range_are_refused_by_key():
    """A val.acc_0 outside [0, 1] or a negative train_tokens is no training figure: before, 1.5 made every
    healthy eval a suspected fault and -0.2 made none ever one, silently."""
    src = Path("metrics/train_scratch.json")
    assert checks.training_figures({"val": {"acc_0": 1}, "train_tokens": 0}, src) == {"acc_0": 1.0, "train_tokens": 0}
    assert checks.training_figures({"val": {"acc_0": 0}, "train_tokens": 10**15}, src)["train_tokens"] == 10**15
    for bad, key in (({"val": {"acc_0": 1.5}, "train_tokens": 10}, "'val.acc_0' is 1.5, not a fraction in"),
                     ({"val": {"acc_0": -0.2}, "train_tokens": 10}, "'val.acc_0' is -0.2, not a fraction in"),
                     ({"val": {"acc_0": True}, "train_tokens": 10}, "'val.acc_0' is True"),
                     ({"val": {"acc_0": float("inf")}, "train_tokens": 10}, "'val.acc_0' is inf"),
                     ({"val": {"acc_0": 0.3}, "train_tokens": -5}, "'train_tokens' is -5, not a whole number >= 0"),
                     ({"val": {"acc_0": 0.3}, "train_tokens": True}, "'train_tokens' is True"),
                     ({"val": [0.3], "train_tokens": 10}, "'val' is \\[0.3\\]")):
        with pytest.raises(ValueError, match=f"^metrics/train_scratch.json: {key}"):
            checks.training_figures(bad, src)


@pytest.mark.parametrize("write, says", [
    (lambda p: p.write_text('{"val": {"acc_0": 0.4}, "train_'), "metrics/train_x.json: not valid JSON (line 1)"),
    (lambda p: p.write_text("[0.4, 100]"), "metrics/train_x.json: the top level is an array"),
    (lambda p: p.write_bytes(b"\xff\xfe{}"), "metrics/train_x.json: not UTF-8 text"),
    (lambda p: p.mkdir(), "Is a directory: 'metrics/train_x.json'"),
    (lambda p: p.write_text('{"val": {"acc_0": 7}, "train_tokens": 10}'), "metrics/train_x.json: 'val.acc_0' is 7"),
])
def test_the_stage_refuses_a_bad_training_file_by_name(tmp_path, monkeypatch, write, says):
    """stages/eval_accept_len.py trained_figures: every way the file can be bad is a SystemExit naming it
    (before: a directory was read as no training file, silently, and a non-UTF-8 file's message did not name
    it); the eval has measured nothing yet, so nothing is lost."""
    monkeypatch.chdir(tmp_path)
    Path("metrics").mkdir()
    write(Path("metrics/train_x.json"))
    with pytest.raises(SystemExit, match="^eval-accept-len@x: .*" + says.replace("(", "\\(").replace(")", "\\)")):
        stage.trained_figures("x")
    Path("metrics/other.json").write_text("{}")
    assert stage.trained_figures("y") is None  # no file: an imported drafter, no training figures


def test_misconfiguration_with_unknown_or_impossible_figures():
    """A NaN position-0 rate or accept_len is unknown (before: NaN raised 'cannot convert float NaN to
    integer'); a rate above 1 or a negative or fractional step count is refused by its key (before: a
    wilson_upper error naming neither)."""
    base = {"accept_len": 2.0, "num_verify_steps": 50, "per_position_accept_rate": [0.6, 0.3]}
    for rates in ([float("nan"), 0.3], [None], [], None):
        assert checks.misconfiguration({**base, "per_position_accept_rate": rates}, DEFAULT_TRAINED) == \
            {"suspected": False, "reasons": [], "note": None, "trained": DEFAULT_TRAINED}
    assert checks.misconfiguration({**base, "accept_len": float("nan")}, DEFAULT_TRAINED)["suspected"] is False
    low = checks.misconfiguration({**base, "accept_len": float("nan"), "per_position_accept_rate": [0.01]})
    assert low["reasons"] == [f"position-0 acceptance rate 0.010 < {checks.SUSPECT_POSITION0_RATE}: the first "
                              f"draft token is almost never the target's"]
    for steps in (0, None):
        out = checks.misconfiguration({**base, "num_verify_steps": steps}, DEFAULT_TRAINED)
        assert out == {"suspected": False, "reasons": [], "note": None, "trained": DEFAULT_TRAINED}
    for bad, says in (({"per_position_accept_rate": [1.5]}, "per_position_accept_rate\\[0\\] is 1.5"),
                      ({"per_position_accept_rate": [-0.1]}, "per_position_accept_rate\\[0\\] is -0.1"),
                      ({"num_verify_steps": -3}, "num_verify_steps is -3"),
                      ({"num_verify_steps": 12.5}, "num_verify_steps is 12.5")):
        with pytest.raises(ValueError, match=f"^{says}"):
            checks.misconfiguration({**base, **bad}, DEFAULT_TRAINED)
