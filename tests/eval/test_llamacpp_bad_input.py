"""Bad input on the llama.cpp path refused by name: agreement with nothing to compare, a drafter
GGUF at models/<name>.gguf that is missing, empty, truncated or a target's, a llama-server that
cannot start or is interrupted while starting (no process left behind), `eyas inspect`'s
flags on a GGUF, serve_benchmark's arguments and recommended_k's rows, and benchmarks/bench_engine.py's
kept pair (`--work`) that it cannot serve again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eyas.cli import main
from eyas.eval.evaluate import EvalError, engine_part
from eyas.eval.llamacpp import (
    EngineError,
    LlamaServer,
    agreement,
    prompt_decodes,
    recommended_k,
    request_metrics,
    serve_benchmark,
    server_binary,
)
from eyas.params.full import default_params
from eyas.target.model import embedded_target
from stages.eval_accept_len import eval_files
from tests.export.test_gguf import _tiny_drafter, _write_gguf


def _row(steps: int, new: int, sha: str) -> dict:
    return {"verify_steps": steps, "new_tokens": new, "output_sha256": sha}


def test_agreement_with_no_prompt_compared_is_unchecked_not_passed():
    # the control: one equal output, within the tolerance -> ok True; outside it -> ok False
    a = agreement([_row(10, 31, "a")], [_row(10, 31, "a")])
    assert (a["ok"], a["compared"], a["unchecked"]) == (True, 1, None)
    assert agreement([_row(20, 31, "a")], [_row(10, 31, "a")])["ok"] is False
    # every output differs: nothing compared, ok is None (not True) with the reason
    a = agreement([_row(10, 31, "a"), _row(9, 31, "b")], [_row(10, 31, "x"), _row(9, 31, "y")])
    assert a["compared"] == 0 and a["ok"] is None
    assert a["unchecked"].startswith("none of the 2 prompts has the same greedy output")
    a = agreement([], [])
    assert a["ok"] is None and a["unchecked"] == "no prompts to compare"
    with pytest.raises(ValueError, match="1 engine prompts vs 2 of eyas'"):
        agreement([_row(1, 2, "a")], [_row(1, 2, "a")] * 2)


def _reply(n: int, n_decode: int, accepted: int = 0, drafted: int = 0, stop: str = "limit") -> dict:
    return {"tokens": list(range(n)), "n_decode": n_decode, "draft_n_accepted": accepted, "draft_n": drafted,
            "predicted_ms": 1.0, "stop_type": stop}


def test_verify_steps_are_the_targets_decodes_after_the_prompts():
    """Counters llama-server gave for one chat prompt of the GPU profile's eval (2,159 prompt tokens, k = 8,
    25 tokens ending in end-of-sequence): without the drafter 26 decodes, with it 9, 18 drafts accepted.
    Its debug log (-lv 99) shows 7 verify steps, the last accepting 8 drafts, the 8th the end token, and its
    bonus token dropped; eyas' walk with the same drafts (its one near-tie decided llama.cpp's way) takes 7 too.
    tokens_after_first - accepted gives 6."""
    plain, spec = _reply(25, 26, stop="eos"), _reply(25, 9, accepted=18, drafted=56, stop="eos")
    assert prompt_decodes(plain) == 2  # 2,159 prompt tokens: two batches of at most 2,048
    assert request_metrics(spec, prompt_decodes(plain))["verify_steps"] == 7
    assert 25 - 1 - 18 == 6  # the control: the count from the accepted drafts is one short here
    # stopped at max_new_tokens (64), 49 accepted: both counts give 14 (the log shows 14 steps)
    plain, spec = _reply(64, 65), _reply(64, 16, accepted=49, drafted=106)
    assert request_metrics(spec, prompt_decodes(plain))["verify_steps"] == 14 == 64 - 1 - 49
    assert request_metrics(plain, prompt_decodes(plain))["verify_steps"] == 63  # without a drafter: one a token
    assert request_metrics(_reply(1, 2), 2)["verify_steps"] == 0  # the prompt's own token only
    # at end-of-sequence, drafts the target accepts past the end token count as accepted, yet are not output:
    # more steps than the tokens less the accepted drafts, up to one a token (the same counts at a limit: refused)
    assert request_metrics(_reply(25, 12, accepted=18, drafted=80, stop="eos"), 2)["verify_steps"] == 10
    with pytest.raises(EngineError, match="10 verify steps .* expected 6 to 7"):
        request_metrics(_reply(25, 12, accepted=18, drafted=80), 2)


@pytest.mark.parametrize("reply, decodes, msg", [
    (_reply(25, 9), 9, "0 verify steps .* for 25 generated tokens with 0 accepted drafts .*: expected 24 to 25"),
    (_reply(25, 40), 2, "38 verify steps .* for 25 generated tokens"),
    # the drafter's decodes counted too: 57 steps where 80 accepted drafts leave 19 or 20
    (_reply(100, 58, accepted=80, drafted=400), 1, "57 verify steps .* expected 19 to 20"),
    (_reply(25, 30, accepted=20, drafted=5), 2, "20 accepted of 5 drafted tokens"),
    (_reply(25, 30, accepted=-3, drafted=5), 2, "-3 accepted of 5 drafted tokens"),
])
def test_counters_that_do_not_count_decodes_are_an_engine_error(reply, decodes, msg):
    with pytest.raises(EngineError, match=msg):
        request_metrics(reply, decodes)
    with pytest.raises(EngineError, match="counted 10 decodes for 25 tokens without a drafter"):
        prompt_decodes(_reply(25, 10))


def test_serve_benchmark_refuses_no_prompts_by_name(tmp_path):
    with pytest.raises(ValueError, match="no prompts to serve with .*d.gguf"):
        serve_benchmark(tmp_path / "t.gguf", tmp_path / "d.gguf", [], k=4, max_new_tokens=8, threads=1,
                        log_dir=tmp_path)


@pytest.mark.parametrize("prompts, kw, msg", [
    ([[1, 2], []], {}, r"prompts \[1\] hold no token"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens 0 and threads 1 must be >= 1"),
    ([[1, 2]], {"threads": 0}, "max_new_tokens 8 and threads 0 must be >= 1"),
    ([[1, 2]], {"k_sweep": [0, 3]}, r"k must be >= 1, got 0"),
])
def test_serve_benchmark_refuses_bad_arguments_before_serving(tmp_path, prompts, kw, msg):
    # no GGUF exists at these paths: the argument is refused before any server starts
    args = {"k": 4, "max_new_tokens": 8, "threads": 1, "log_dir": tmp_path, **kw}
    with pytest.raises(ValueError, match=msg):
        serve_benchmark(tmp_path / "t.gguf", tmp_path / "d.gguf", prompts, **args)
    assert not list(tmp_path.iterdir())


def test_the_recommended_k_is_the_fastest_lossless_one():
    rows = {"2": {"speedup": 1.4, "lossless": True}, "4": {"speedup": 1.9, "lossless": False},
            "6": {"speedup": 1.6, "lossless": True}, "8": {"speedup": None, "lossless": True}}
    assert recommended_k(rows) == 6  # k = 4 is faster but changes the output: no choice
    assert recommended_k({**rows, "4": {"speedup": 1.9, "lossless": True}}) == 4
    assert recommended_k({"3": {"speedup": 1.2, "lossless": True}, "5": {"speedup": 1.2, "lossless": True}}) == 3
    assert recommended_k({"4": {"speedup": 1.9, "lossless": False}}) is None


def test_the_recommended_k_refuses_rows_it_cannot_read():
    """A NaN speedup is unmeasured (before: a NaN row first in k order was recommended over a faster one);
    a key that is not a k, a row that is not an object, a non-bool lossless or a non-numeric speedup is
    refused by its key (before: KeyError '3' for "03", int()'s message for "k3", 'false' read as lossless,
    a string speedup recommended alone, and a TypeError beside a number)."""
    nan = float("nan")
    assert recommended_k({"1": {"speedup": nan, "lossless": True}, "2": {"speedup": 1.5, "lossless": True}}) == 2
    assert recommended_k({"2": {"speedup": 1.5, "lossless": True}, "3": {"speedup": nan, "lossless": True}}) == 2
    assert recommended_k({"3": {"speedup": nan, "lossless": True}}) is None
    assert recommended_k({"3": {"lossless": True}, "5": {"speedup": 1.1}}) is None  # missing keys: no candidate
    assert recommended_k({3: {"speedup": 1.2, "lossless": True}}) == 3
    for rows, says in (({"03": {"speedup": 1.5, "lossless": True}}, "row '03': not a k"),
                       ({"k3": {"speedup": 1.5, "lossless": True}}, "row 'k3': not a k"),
                       ({"2.0": {"speedup": 1.5, "lossless": True}}, "row '2.0': not a k"),
                       ({"0": {"speedup": 1.5, "lossless": True}}, "row '0': not a k"),
                       ({"-1": {"speedup": 1.5, "lossless": True}}, "row '-1': not a k"),
                       ({True: {"speedup": 1.5, "lossless": True}}, "row True: not a k"),
                       ({"3": None}, "row '3': None is not an object"),
                       ({"3": {"speedup": 1.2, "lossless": "false"}}, "row '3': 'lossless' is 'false'"),
                       ({"1": {"speedup": "fast", "lossless": True}}, "row '1': 'speedup' is 'fast'"),
                       ({"1": {"speedup": "fast", "lossless": True}, "2": {"speedup": 1.5, "lossless": True}},
                        "row '1': 'speedup' is 'fast'"),
                       ({"3": {"speedup": True, "lossless": True}}, "row '3': 'speedup' is True")):
        with pytest.raises(ValueError, match=f"^k sweep {says}"):
            recommended_k(rows)


def test_the_recommended_k_refuses_a_sweep_it_cannot_read_whole():
    """The rows as a whole and the figures beside the speedup: rows that are not an object, a k given twice
    (``"2"`` and ``2``), a ``speedup_flagged`` that is not a bool or None and a speedup of 0 or below are
    refused by name (before: an AttributeError, both rows read as one k, a flag
    of ``"true"`` or 1 read as unflagged so its speedup was recommended, and a negative speedup
    recommended); an infinite speedup is unmeasured, as NaN is (before: recommended over a measured one)."""
    inf, good = float("inf"), {"speedup": 1.2, "lossless": True}
    assert recommended_k({"2": good, "3": {"speedup": inf, "lossless": True}}) == 2
    assert recommended_k({"2": good, "3": {"speedup": 1.9, "lossless": True, "speedup_flagged": None}}) == 3
    for rows, says in (([("2", good)], r"rows \[\('2', .*\)\] are not an object"),
                       (None, "rows None are not an object"),
                       ({"2": good, 2: {"speedup": 3.0, "lossless": True}}, "row 2: k 2 twice"),
                       ({"2": good, "3": {"speedup": 1.9, "lossless": True, "speedup_flagged": "true"}},
                        "row '3': 'speedup_flagged' is 'true', not true or false"),
                       ({"2": good, "3": {"speedup": 1.9, "lossless": True, "speedup_flagged": 1}},
                        "row '3': 'speedup_flagged' is 1, not true or false"),
                       ({"2": {"speedup": -1.2, "lossless": True}}, r"row '2': 'speedup' is -1.2, not a ratio > 0"),
                       ({"2": good, "3": {"speedup": 0, "lossless": True}}, "row '3': 'speedup' is 0, not a ratio > 0"),
                       ({"2": {"speedup": -inf, "lossless": True}}, "row '2': 'speedup' is -inf, not a ratio > 0")):
        with pytest.raises(ValueError, match=f"^k sweep {says}"):
            recommended_k(rows)


@pytest.mark.parametrize("prompts, kw, msg", [
    ([[1, 2]], {"k": 2.5}, r"k 2.5 and k_sweep \[\] must be whole numbers"),
    ([[1, 2]], {"k": True}, r"k True and k_sweep"),
    ([[1, 2]], {"k_sweep": ["3"]}, r"k 4 and k_sweep \['3'\] must be whole numbers"),
    ([[1, 2]], {"k_sweep": [2.5]}, r"k 4 and k_sweep \[2.5\] must be whole numbers"),
    ([[1, 2]], {"threads": 1.5}, "max_new_tokens 8 and threads 1.5 must be >= 1, whole numbers"),
    ([[1, 2]], {"max_new_tokens": None}, "max_new_tokens None and threads 1 must be >= 1, whole numbers"),
    ([[1, "a"], [3]], {}, r"prompts \[0\] hold a token id that is not a whole number >= 0"),
    ([[3], [-1]], {}, r"prompts \[1\] hold a token id"),
    ("abc", {}, "prompts must be a list of token-id lists"),
    ([[1, 2]], {}, "target_gguf .*t.gguf is not a file"),
])
def test_serve_benchmark_refuses_wrong_types_before_serving(tmp_path, prompts, kw, msg):
    """Before: a fractional k or threads reached llama-server (which reads --draft-max 2.5 as 2), a None or a
    string raised a TypeError naming nothing, a bad token id or a missing GGUF started a server first."""
    args = {"k": 4, "max_new_tokens": 8, "threads": 1, "log_dir": tmp_path / "logs", **kw}
    with pytest.raises((ValueError, FileNotFoundError), match=f"^serve_benchmark: {msg}"):
        serve_benchmark(tmp_path / "t.gguf", tmp_path / "d.gguf", prompts, **args)
    assert not list(tmp_path.iterdir())  # no server started, no log written


def test_eval_refuses_a_drafter_gguf_it_cannot_read_before_serving(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _tiny_drafter(tmp_path / "models" / "x")
    gguf = tmp_path / "models" / "x.gguf"
    good = _write_gguf(tmp_path / "eagle3.gguf").read_bytes()
    cases = {"absent": (None, "models/x.gguf: no such GGUF file"),
             "empty": (b"", "models/x.gguf: not a GGUF file"),
             "truncated": (good[:200], "models/x.gguf: a GGUF file cut short (truncated: 200 bytes"),
             "a target's": (_write_gguf(tmp_path / "llama.gguf", arch="llama").read_bytes(),
                            "general.architecture is 'llama', not 'eagle3'"),
             # the control: a readable eagle3 file of another drafter, refused by the checks it already had
             "another drafter's": (good, "llama.cpp would not serve the drafter of models/x as trained")}
    for case, (data, msg) in cases.items():
        gguf.unlink(missing_ok=True)
        if data is not None:
            gguf.write_bytes(data)
        with pytest.raises(EvalError) as e:
            engine_part("x", default_params(), [[1, 2, 3]], "chat", 8, eval_files("x"))
        assert msg in str(e.value) and "`dvc repro export-gguf@x`" in str(e.value), (case, str(e.value))
        assert str(e.value).startswith("eval x chat: "), case
    assert not (tmp_path / ".eyas").exists()  # no server log: nothing was started


def test_a_binary_that_cannot_start_is_an_engine_error(tmp_path, monkeypatch):
    bad = tmp_path / "llama-server"
    bad.write_text("not a program")  # not executable
    monkeypatch.setattr("eyas.eval.llamacpp.server_binary", lambda backend="cpu": bad)
    with pytest.raises(EngineError, match=r"cannot start llama-server \(.*llama-server -m .*PermissionError.*"
                                          r"build_llama_server\.sh"):
        with LlamaServer(tmp_path / "t.gguf", None, k=4, threads=1, ctx=64, log=tmp_path / "l.log"):
            pass


def _have_server() -> bool:
    try:
        server_binary()
    except EngineError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.slow  # starts llama-server (seconds)
@pytest.mark.skipif(not _have_server(), reason="llama-server not built: bash scripts/build_llama_server.sh")
def test_an_interrupt_while_the_server_starts_leaves_no_process(tmp_path, monkeypatch):
    """Ctrl-C while llama-server loads (started, /health not answering yet): the server is stopped
    before the KeyboardInterrupt propagates. The interrupt is raised at the health poll's wait, as
    Ctrl-C there would: a timer's ``_thread.interrupt_main`` was lost in a long suite under load
    (CPython drops an interrupt raised inside a finalizer) and can land after the server is healthy."""
    import eyas.eval.llamacpp as llamacpp

    d, f = embedded_target()
    s = LlamaServer(Path(d, f), None, k=4, threads=1, ctx=64, log=tmp_path / "l.log")
    alive_when_interrupted = []

    def ctrl_c(_seconds):
        alive_when_interrupted.append(_alive(s.proc.pid))
        raise KeyboardInterrupt

    monkeypatch.setattr(llamacpp, "time", SimpleNamespace(monotonic=time.monotonic, sleep=ctrl_c))
    entered = False
    with pytest.raises(KeyboardInterrupt):
        with s:
            entered = True
            raise KeyboardInterrupt  # healthy at its first poll: nothing interrupted the start (skipped below)
    if entered:
        pytest.skip("the server was healthy at its first poll: the start was not interrupted")
    assert alive_when_interrupted == [True]  # the control: the server was running when Ctrl-C came
    assert not _alive(s.proc.pid) and s.proc.returncode is not None


@pytest.mark.slow  # starts llama-server (a second)
@pytest.mark.skipif(not _have_server(), reason="llama-server not built: bash scripts/build_llama_server.sh")
def test_a_server_that_exits_at_start_names_the_command_and_the_log(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"x" * 100)
    s = LlamaServer(junk, None, k=4, threads=1, ctx=64, log=tmp_path / "l.log")
    with pytest.raises(EngineError, match=r"(?s)llama-server exited \d+ \(.*-m .*junk\.gguf.*invalid magic"):
        with s:
            pass
    assert not _alive(s.proc.pid)


def test_inspect_flags_on_a_gguf_are_refused_by_name(tmp_path, capsys):
    g = _write_gguf(tmp_path / "g.gguf")
    d = _tiny_drafter(tmp_path / "d")
    assert main(["inspect", str(g), "--drafter", str(d)]) == 1  # the control: a directory is read (its errors)
    capsys.readouterr()
    for bad in (g, d / "model.safetensors", tmp_path / "nope"):
        assert main(["inspect", str(g), "--drafter", str(bad)]) == 2
        assert f"--drafter {bad} is not a directory" in capsys.readouterr().err
    for n in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as e:
            main(["inspect", str(g), "--num-target-layers", n])
        assert e.value.code == 2 and f"must be an integer >= 1, got '{n}'" in capsys.readouterr().err
    assert main(["inspect", str(g), "--num-target-layers", "30"]) == 0
    # a GGUF under another name is read as a GGUF, not as a checkpoint directory
    for name in ("G.GGUF", "drafter.bin"):
        (tmp_path / name).write_bytes(g.read_bytes())
        assert main(["inspect", str(tmp_path / name), "--num-target-layers", "30"]) == 0, name
        assert "[GGUF, general.architecture eagle3" in capsys.readouterr().out
    assert main(["inspect", str(d)]) == 0  # the control: a checkpoint directory is still one


def _record_beside(tmp_path, monkeypatch, name: str, record) -> None:
    """A fake build of ``name`` in a scripts dir of its own, its build record holding ``record``."""
    import json
    import sysconfig

    exe = tmp_path / name
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (tmp_path / f"{name}.eyas-build.json").write_text(json.dumps(record))
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda key, *a, **k: str(tmp_path) if key == "scripts" else real(key))


def test_a_build_record_of_another_backend_is_refused_by_name(tmp_path, monkeypatch):
    """The CUDA binary's record must say cuda: a record that says cpu (a copied file) would label every
    figure served on the GPU as the CPU build's (negative control: the right record passes)."""
    from eyas.eval.llamacpp import build_info

    good = {"sources": "llama-cpp-python==0.3.36 (sdist, vendor/llama.cpp)", "llama_cpp_commit": "0c1e57098",
            "backend": "cuda", "cmake_flags": "-DGGML_CUDA=ON", "cuda_toolkit": "local"}
    _record_beside(tmp_path, monkeypatch, "llama-server-cuda", good)
    assert build_info("cuda")["backend"] == "cuda"
    for bad in ({**good, "backend": "cpu"}, {}, {"backend": "cuda"}):
        _record_beside(tmp_path, monkeypatch, "llama-server-cuda", bad)
        with pytest.raises(EngineError, match=r"llama-server-cuda\.eyas-build\.json: the build record names backend"):
            build_info("cuda")


def test_draft_statistics_that_fall_or_are_not_numbers_are_an_engine_error(tmp_path):
    """llama.cpp's cumulative speculative statistics read as a difference: counters that fall (another
    run's lines in the log) are refused, not turned into negative times (negative control: rising ones
    give the difference)."""
    line = ("spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    1 {g}   {g}, #gen drafts = 1, "
            "#acc drafts = 1, #gen tokens = 1, #acc tokens = 1, dur(b,g,a) = 0.010, {ms}, 0.100 ms\n")
    s = LlamaServer(tmp_path / "t.gguf", None, k=4, threads=1, ctx=64, log=tmp_path / "l.log")
    s.log.write_text(line.format(g=5, ms="10.0") + line.format(g=12, ms="17.5"))
    assert s.draft_stats() == {"draft_calls": 7, "draft_ms": 7.5}
    s.log.write_text(line.format(g=12, ms="17.5") + line.format(g=5, ms="10.0"))
    with pytest.raises(EngineError, match=r"counters fell from 12 calls"):
        s.draft_stats()
    s.log.write_text(line.format(g=5, ms="10.0") + line.format(g=6, ms="1.2.3"))
    with pytest.raises(EngineError, match=r"duration is not a number"):
        s.draft_stats()


# --- benchmarks/bench_engine.py --work: a kept pair it cannot serve again -------------------------

def _bench_engine(monkeypatch, *args: str) -> str:
    """benchmarks/bench_engine.py's main with ``args`` after ``--shape tiny``; the SystemExit message it
    stops with."""
    import benchmarks.bench_engine as bench_engine
    monkeypatch.setattr("sys.argv", ["bench_engine.py", "--shape", "tiny", *args])
    with pytest.raises(SystemExit) as stop:
        bench_engine.main()
    return str(stop.value)


@pytest.mark.parametrize("made, says", [
    ('{"args": {"shape": "tiny", "outt', "made.json: not valid JSON (line 1)"),
    ("not json at all", "made.json: not valid JSON (line 1)"),
    ('["args"]', "made.json: the top level is an array"),
    ('{"args": {}}', "made.json: lacks ['params', 'prompts', 'new_tokens_eyas', 'drafter', 'eyas_accept_len', "
                     "'eyas_per_prompt', 'seconds']: not a pair this script kept"),
    (None, "made.json: Is a directory"),
])
def test_bench_engine_refuses_a_kept_pair_it_cannot_read(tmp_path, monkeypatch, made, says):
    """Before: a truncated or non-JSON made.json was a JSONDecodeError traceback, one lacking keys a KeyError,
    a directory in its place an IsADirectoryError. Now each stops by name, before any model is made, and the
    kept directory is left as it was."""
    work = tmp_path / "w"
    work.mkdir()
    if made is None:
        (work / "made.json").mkdir()
    else:
        (work / "made.json").write_text(made)
    (work / "target.gguf").write_bytes(b"kept")
    before = sorted(p.name for p in work.iterdir())
    msg = _bench_engine(monkeypatch, "--backends", "--work", str(work))
    assert says.split(": ", 1)[1] in msg and f"{work}/made.json" in msg, msg
    assert sorted(p.name for p in work.iterdir()) == before and (work / "target.gguf").read_bytes() == b"kept"


def test_bench_engine_refuses_other_arguments_a_missing_gguf_and_a_file_as_work(tmp_path, monkeypatch):
    import benchmarks.bench_engine as bench_engine
    work = tmp_path / "w"
    work.mkdir()
    same = bench_engine.pair_args(bench_engine.arguments(["--shape", "tiny", "--backends", "--work", str(work)]))
    made = {**{k: None for k in bench_engine.MADE_KEYS}, "seconds": {}}
    (work / "made.json").write_text(json.dumps({**made, "args": {**same, "seed": 1}}))
    msg = _bench_engine(monkeypatch, "--backends", "--work", str(work))  # held before
    assert msg.startswith(f"{work}/made.json: made with {{") and "another --work, or the same arguments" in msg
    # the same arguments, a GGUF gone: named before serving (before: llama-server started on a missing file)
    (work / "made.json").write_text(json.dumps({**made, "args": same}))
    (work / "drafter.gguf").write_bytes(b"kept")
    assert _bench_engine(monkeypatch, "--backends", "--work", str(work)) == (
        f"{work}/made.json: its target.gguf not in {work}; delete {work} or give another --work to make the pair again")
    # a file where the work directory goes (before: FileExistsError's traceback)
    (tmp_path / "f").write_text("a file")
    assert _bench_engine(monkeypatch, "--backends", "--work", str(tmp_path / "f")).startswith(
        f"--work {tmp_path / 'f'}: not a directory")
    assert (tmp_path / "f").read_text() == "a file"
    # no backend and no --work: nothing to keep the pair in (held before)
    assert _bench_engine(monkeypatch, "--backends") == \
        "--backends with none: only makes the pair, which needs --work to keep it"


@pytest.mark.parametrize("args, says", [
    (["--prompts", "0"], "--prompts 0: must be >= 1"),  # before: max()'s traceback after the target was made
    (["--prompts", "-1"], "--prompts -1: must be >= 1"),  # before: HumanEval[:-1], 163 prompts
    (["--prompts", "165"], "--prompts 165: HumanEval has 164 problems"),  # before: 164 served as if 165
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),  # before: generate_batch's traceback
    (["--cpu-prompts", "0", "--threads", "0"], "--cpu-prompts 0, --threads 0: must be >= 1"),  # after the pair
    (["--epochs", "0"], "--epochs 0: must be >= 1"),  # before: an untrained drafter benchmarked
    (["--ttt", "0"], "--ttt 0: must be >= 1"),  # before: autograd's traceback in training
    (["--draft-vocab", "0"], "--draft-vocab 0: must be >= 1"),
    (["--embed-std", "0"], "--embed-std 0.0: a random target's embedding std is a finite number > 0"),
    (["--embed-std", "-1"], "--embed-std -1.0: a random target's"),  # before: torch's traceback
    (["--embed-std", "nan"], "--embed-std nan: a random target's"),
    (["--shape", "embedded", "--embed-std", "1"], "--embed-std: only a random target has one"),  # before: ignored
    (["--shape", "embedded", "--outtype", "bf16"],
     "--shape embedded: its weights are de-quantised to fp32; serve them as --outtype f32"),  # before: after --work
    (["--out", "{tmp}"], "--out {tmp}: a directory, not a result file"),  # before: IsADirectoryError after serving
    (["--out", "{tmp}/f/r.json"], "--out {tmp}/f/r.json: {tmp}/f is not a directory"),
])
def test_bench_engine_refuses_a_bad_number_or_path_before_making_anything(tmp_path, monkeypatch, args, says):
    import benchmarks.bench_engine as bench_engine
    (tmp_path / "f").write_text("a file")
    args = [x.replace("{tmp}", str(tmp_path)) for x in args]
    shape = [] if "--shape" in args else ["--shape", "tiny"]
    monkeypatch.setattr("sys.argv", ["bench_engine.py", *shape, "--backends", "--work", str(tmp_path / "w"), *args])
    monkeypatch.setattr(bench_engine, "make_pair", lambda a, work: pytest.fail(f"{args} reached make_pair"))
    with pytest.raises(SystemExit) as stop:
        bench_engine.main()
    assert str(stop.value).startswith(says.replace("{tmp}", str(tmp_path))), stop.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no --work made
    # negative control: the same numbers made good pass the check
    good = bench_engine.arguments(["--shape", "tiny", "--prompts", "164", "--embed-std", "0.5", "--ttt", "1"])
    assert (good.prompts, good.embed_std, good.ttt) == (164, 0.5, 1)


def test_a_speedup_past_the_acceptance_length_is_a_timing_fault_not_a_result(capsys):
    from eyas.eval.evaluate import report_engine
    from eyas.eval.llamacpp import speedup_beyond_bound

    # a quick trial beside other jobs: 0 of 100 drafts accepted (accept_len 1.0), yet the plain run was timed
    # at 1.50 tokens/s and the drafter's at 11.10: a 7.42x "speedup" no verify loop can give
    assert speedup_beyond_bound(7.42, 1.0) is True
    assert speedup_beyond_bound(1.9, 2.5) is False and speedup_beyond_bound(2.7, 2.5) is False  # within the slack
    assert speedup_beyond_bound(None, 2.0) is None and speedup_beyond_bound(float("nan"), 2.0) is None
    rows = {"2": {"speedup": 1.4, "lossless": True, "speedup_flagged": False},
            "3": {"speedup": 7.4, "lossless": True, "speedup_flagged": True}}
    assert recommended_k(rows) == 2  # the flagged row is no candidate
    same = {"target_gguf": "target.gguf", "accept_len": 1.0, "speedup": 7.42, "speedup_flagged": True,
            "tokens_per_second": 11.1, "tokens_per_second_plain": 1.5, "lossless": True,
            "per_prompt": [_row(10, 10, "a")]}
    logged = {}
    report_engine("scratch", "chat", {"same_precision": same, "quantized": None},
                  {"accept_len": 1.0, "per_prompt": [_row(10, 10, "a")]}, logged.update)
    out = capsys.readouterr().out
    assert "WARNING llama.cpp's speedup 7.420 is more than its acceptance length 1.000 allows" in out
    assert logged["chat/engine/speedup_flagged"] == 1.0
    same["speedup_flagged"] = False
    report_engine("scratch", "chat", {"same_precision": same, "quantized": None},
                  {"accept_len": 1.0, "per_prompt": [_row(10, 10, "a")]}, logged.update)
    assert "WARNING llama.cpp's speedup" not in capsys.readouterr().out
