"""A killed eval-accept-len resumes the parts it finished (eyas/pipeline/resume.py, stages/eval_accept_len.py,
eyas/eval/evaluate.py).

The stage's body (`run`: eyas.eval.evaluate.evaluate_drafter between its parts file and its outputs)
on the tiny target with a briefly trained drafter, in a temporary
workspace; the kill is a fault injected into the real evaluate_benchmark / evaluate_modes (an
exception on a chosen call), which also count the calls. A rerun must not call a finished part
again, and must print, log and write what the interrupted run saved; the rest of the metrics must
equal an uninterrupted run's apart from wall-clock figures. Plus :class:`eyas.pipeline.resume.Parts` alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import eyas.eval.evaluate as front
import stages.eval_accept_len as stage
from eyas.params.full import default_params
from eyas.pipeline.resume import Parts
from eyas.tracking.runs import Tracker
from tests.tiny import trained_drafter

K = 3
WORK_FILE = Path(".eyas/work/eval_scratch/parts.json")
METRICS_FILE = Path("metrics/eval_scratch.json")
# figures that come from the wall clock: two uninterrupted runs differ in them (and in what follows from them)
WALL_CLOCK = {"speedup", "speedup_iqr", "speedup_flagged", "speedup_predicted", "timing",
              "k_sweep", "greedy_seconds", "speculative_seconds", "serving_verdict"}


class Killed(Exception):
    """Stands for the SIGKILL at the device call's time limit."""


class Recorder(Tracker):
    def __init__(self):
        self.metrics: dict[str, float] = {}

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)


@pytest.fixture(scope="module")
def setup(tiny_greedy):
    """(target, drafter, benchmarks): conftest's tiny target and prompts, a briefly trained drafter,
    two prompts per benchmark."""
    target, prompts, outputs = tiny_greedy
    drafter = trained_drafter(target, prompts, outputs, K, steps=30).eval()
    drafter.config.max_position_embeddings = 20  # < 8 + 12 + K: every prompt warned about, deterministically
    settings = {"max_prompt_tokens": 0, "prompts_shortened": 0, "prompts_dropped_too_long": 0}
    return target, drafter, {"chat": (prompts[:2], settings), "humaneval": (prompts[2:], settings)}


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A workspace: the test split and a local target directory (what the resume key hashes)."""
    monkeypatch.chdir(tmp_path)
    Path("data/conversations").mkdir(parents=True)
    Path("data/conversations/test.jsonl").write_text('{"id": "a", "messages": []}\n')
    Path("target").mkdir()
    Path("target/config.json").write_text("{}")
    p = default_params()
    return dataclasses.replace(
        p, target=dataclasses.replace(p.target, path="./target", gguf_file=None),
        eval=dataclasses.replace(p.eval, num_draft_tokens=K, max_new_tokens=12, timed_prompts=1, timing_repeats=1,
                                 batch_size=2, served_prompts=1, served_max_new_tokens=8, temperatures=[0.0, 0.8],
                                 top_p=0.9, seeds=[3], tree_topk=2, tree_num_steps=K, tree_num_draft_tokens=6),
        serve=dataclasses.replace(p.serve, engine="none"))  # eyas' own parts; the engine's: tests/eval/test_llamacpp.py


def run(setup, p, monkeypatch, capsys, kill_at: tuple[str, int] | None = None):
    """The stage body once; returns (metrics or None when killed, printed lines, logged metrics,
    calls: the prompts each of evaluate_benchmark ("chain") and evaluate_modes ("served") got)."""
    target, drafter, benchmarks = setup
    calls: dict[str, list] = {"chain": [], "served": []}

    def counted(part, real):
        def f(target, drafter, prompts, **kw):
            calls[part].append(prompts)
            if kill_at == (part, len(calls[part])):
                raise Killed(part)
            return real(target, drafter, prompts, **kw)
        return f

    tracker, metrics = Recorder(), None
    with monkeypatch.context() as mp:
        mp.setattr(front, "evaluate_benchmark", counted("chain", front.evaluate_benchmark))
        mp.setattr(front, "evaluate_modes", counted("served", front.evaluate_modes))
        try:
            metrics = stage.run("scratch", p, target, drafter, benchmarks, tracker)
        except Killed:
            pass
    return metrics, capsys.readouterr().out.splitlines(), tracker.metrics, calls


def scrub(x):
    """``x`` without its wall-clock figures (:data:`WALL_CLOCK`)."""
    if isinstance(x, dict):
        return {k: scrub(v) for k, v in x.items() if k not in WALL_CLOCK}
    if isinstance(x, list):
        return [scrub(v) for v in x]
    return x


def test_killed_eval_resumes_finished_parts(setup, ws, monkeypatch, capsys):
    chat, humaneval = setup[2]["chat"][0], setup[2]["humaneval"][0]
    ref, _, ref_logged, calls = run(setup, ws, monkeypatch, capsys)
    assert calls == {"chain": [chat, humaneval], "served": [chat[:1], humaneval[:1]]}
    assert ref == json.loads(METRICS_FILE.read_text())
    assert not WORK_FILE.parent.exists()  # removed with its file once the metrics were written
    METRICS_FILE.unlink()

    # killed in the second part (the humaneval chain): the chat parts are saved, nothing else
    killed, killed_out, killed_logged, calls = run(setup, ws, monkeypatch, capsys, kill_at=("chain", 2))
    assert killed is None and not METRICS_FILE.exists()
    saved = json.loads(WORK_FILE.read_text())
    assert sorted(saved["parts"]) == ["chat/chain", "chat/served"]
    assert saved["resume_key"]["params"]["eval.top_p"] == 0.9

    metrics, out, logged, calls = run(setup, ws, monkeypatch, capsys)
    assert calls == {"chain": [humaneval], "served": [humaneval[:1]]}  # the chat parts are not recomputed
    assert f"eval scratch chat: chain resumed from {WORK_FILE}" in out
    assert f"eval scratch chat: served table resumed from {WORK_FILE}" in out
    assert metrics == json.loads(METRICS_FILE.read_text())
    assert not WORK_FILE.exists()
    # the saved parts are the results: the same lines, warnings, MLflow metrics and JSON as when made
    assert [x for x in out if x.startswith("eval scratch chat") and "resumed" not in x] == \
        [x for x in killed_out if x.startswith("eval scratch chat")]
    assert any("WARNING" in x for x in out if x.startswith("eval scratch chat"))
    assert {k: v for k, v in logged.items() if k.startswith("chat/")} == killed_logged
    eagle = saved["parts"]["chat/chain"]["eagle"]
    # a part holds measurements; the prompt settings, checks and verdicts are recomputed on every run
    judged = {"positions", "suspected_misconfiguration", "serving_verdict"}
    assert not judged & set(eagle)
    assert {k: v for k, v in metrics["chat"].items() if k not in judged | {"settings"}} == \
        {k: v for k, v in eagle.items() if k != "settings"}
    assert metrics["ngram"]["chat"] == saved["parts"]["chat/chain"]["ngram"]
    assert metrics["served"]["chat"] == saved["parts"]["chat/served"]
    # and the whole equals an uninterrupted run's, wall-clock figures apart
    assert scrub(metrics) == scrub(ref) and set(logged) == set(ref_logged)
    assert {k: v for k, v in logged.items() if "speedup" not in k and "worth_serving" not in k} == \
        {k: v for k, v in ref_logged.items() if "speedup" not in k and "worth_serving" not in k}


def test_resumed_parts_are_judged_by_the_code_that_runs_now(setup, ws, monkeypatch, capsys):
    """Killed, then the verdict code changes before the rerun: the resumed chat part and the fresh
    humaneval part both carry the new code's verdict (one metrics file never mixes two versions)."""
    from eyas.eval import checks as eval_checks

    run(setup, ws, monkeypatch, capsys, kill_at=("chain", 2))
    real = eval_checks.serving_verdict
    monkeypatch.setattr(eval_checks, "serving_verdict", lambda r, n: {**real(r, n), "code": "new"})
    metrics, out, _, calls = run(setup, ws, monkeypatch, capsys)
    assert f"eval scratch chat: chain resumed from {WORK_FILE}" in out and len(calls["chain"]) == 1
    assert metrics["chat"]["serving_verdict"]["code"] == metrics["humaneval"]["serving_verdict"]["code"] == "new"


def test_the_resume_key_holds_the_stage_code_torch_and_device(ws):
    """A code change, another torch or another device makes another key (speedups are wall clock)."""
    key = stage.resume_key("scratch", ws, {"chat": [[1, 2]]}, "cpu")
    assert key["device"] == "cpu" and key["torch"] == torch.__version__ and len(key["code"]) == 64
    assert key == stage.resume_key("scratch", ws, {"chat": [[1, 2]]}, torch.device("cpu"))
    assert key["prompt_ids"] != stage.resume_key("scratch", ws, {"chat": [[1, 3]]}, "cpu")["prompt_ids"]


def test_changed_eval_param_recomputes_everything(setup, ws, monkeypatch, capsys):
    run(setup, ws, monkeypatch, capsys, kill_at=("served", 2))  # three parts saved
    assert len(json.loads(WORK_FILE.read_text())["parts"]) == 3
    p = dataclasses.replace(ws, eval=dataclasses.replace(ws.eval, top_p=0.95))
    metrics, out, _, calls = run(setup, p, monkeypatch, capsys)
    assert len(calls["chain"]) == 2 and len(calls["served"]) == 2
    assert not [x for x in out if "resumed" in x]
    assert f"eval scratch: {WORK_FILE}: made under another resume key (params.eval.top_p changed): starting " \
           "fresh, its 3 part(s) discarded" in out
    assert metrics["served"]["chat"]["settings"]["top_p"] == 0.95 and not WORK_FILE.exists()


def test_corrupt_work_file_is_ignored(setup, ws, monkeypatch, capsys):
    run(setup, ws, monkeypatch, capsys, kill_at=("chain", 2))
    WORK_FILE.write_text(WORK_FILE.read_text()[:100])  # torn
    metrics, out, _, calls = run(setup, ws, monkeypatch, capsys)
    assert len(calls["chain"]) == 2 and len(calls["served"]) == 2
    assert any(x.startswith(f"eval scratch: {WORK_FILE}: unreadable (") and x.endswith("starting fresh")
               for x in out), out
    assert metrics == json.loads(METRICS_FILE.read_text()) and not WORK_FILE.exists()


# ------------------------------------------------------------------------------ Parts on its own

def test_parts_resume_store_and_replace(tmp_path):
    path = tmp_path / "w" / "parts.json"
    parts = Parts(path, {"a": 1, "b": {"c": (1, 2)}})
    assert parts.discarded is None and parts.names == []
    got = parts.add("x", {"t": (1, 2), 3: math.nan, "f": 0.1})  # returned as a rerun reads it
    assert got == {"t": [1, 2], "3": None, "f": 0.1}
    got["f"] = 9  # a caller's edit does not reach the store
    with pytest.raises(TypeError):
        parts.add("y", {"bad": object()})
    again = Parts(path, {"a": 1, "b": {"c": [1, 2]}})  # the key as stored (JSON round trip)
    assert again.discarded is None and again.names == ["x"] and again.get("x")["f"] == 0.1
    assert again.get("y") is None
    other = Parts(path, {"a": 2, "b": {"c": [1, 3]}})
    assert other.discarded.endswith("(a, b.c changed): starting fresh, its 1 part(s) discarded")
    assert json.loads(path.read_text()) == {"resume_key": {"a": 2, "b": {"c": [1, 3]}}, "parts": {}}
    for text, why in (("{\"resume_key\": {\"a\": 2}, \"par", "unreadable (" + str(path)),
                      ("[1, 2]", "the top level is an array ([1, 2]), expected a JSON object"),
                      ("{\"parts\": {}}", "not a parts file"), ("\xff\xfe", "unreadable (")):
        path.write_bytes(text.encode("latin-1"))
        assert why in Parts(path, {"a": 2}).discarded
        assert json.loads(path.read_text()) == {"resume_key": {"a": 2}, "parts": {}}
    Parts(path, {"a": 2}).remove()
    assert not path.parent.exists()


def test_code_digest_covers_the_files_the_stage_imports():
    """The digest is over the stage's import closure: stable, and another stage's code (another
    closure) gives another digest; eyas/pipeline/resume.py itself is in the eval stage's closure."""
    from eyas.pipeline.resume import code_digest
    from eyas.pipeline.stage_deps import closure

    assert code_digest("stages.eval_accept_len") == code_digest("stages.eval_accept_len")
    assert code_digest("stages.eval_accept_len") != code_digest("stages.build_vocab")
    assert "eyas/pipeline/resume.py" in closure(Path(__file__).resolve().parents[2], ["stages.eval_accept_len"])


def test_a_malformed_part_is_recomputed_and_a_directory_is_named(setup, ws, monkeypatch, capsys):
    """A part of the wrong shape under the right key (a hand-edited file) is dropped with a message
    and recomputed, not read into a traceback on every rerun; a directory where the work file goes
    is an error naming it."""
    run(setup, ws, monkeypatch, capsys, kill_at=("chain", 2))
    saved = json.loads(WORK_FILE.read_text())
    saved["parts"]["chat/chain"] = 5
    saved["parts"]["chat/served"] = {"no": "rows"}
    WORK_FILE.write_text(json.dumps(saved))
    metrics, out, _, calls = run(setup, ws, monkeypatch, capsys)
    assert f"eval scratch: {WORK_FILE}: part 'chat/chain' is not a result of this stage: recomputing it" in out
    assert f"eval scratch: {WORK_FILE}: part 'chat/served' is not a result of this stage: recomputing it" in out
    assert len(calls["chain"]) == 2 and len(calls["served"]) == 2 and metrics["chat"]["accept_len"] > 0
    METRICS_FILE.unlink()
    WORK_FILE.mkdir(parents=True)
    with pytest.raises(IsADirectoryError, match=f"{WORK_FILE}: a directory where the work file"):
        run(setup, ws, monkeypatch, capsys)
