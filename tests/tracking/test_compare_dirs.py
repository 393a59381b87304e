"""`eyas compare --metrics`: the params shown beside a metrics directory are the ones that made it."""

import json
import os

import pytest

from eyas.tracking.compare import CompareError
from eyas.tracking.compare_dirs import compare_dirs, lock_params

LOCK = """schema: '2.0'
stages:
  train-scratch:
    cmd: python -m stages.train_scratch
    params:
      params.yaml:
        train:
          epochs: 4
        vocab.draft_vocab_size: 6144
    outs:
    - path: metrics/train_scratch.json
      hash: md5
      md5: 0
  elsewhere:
    cmd: python -m stages.elsewhere
    params:
      params.yaml:
        train:
          epochs: 9
        only.elsewhere: 1
    outs:
    - path: models/elsewhere
      hash: md5
      md5: 0
"""
# the fine-tune comparison's lock (finetune/dvc.yaml): its paths are relative to the repository root too
FINETUNE_LOCK = """schema: '2.0'
stages:
  train-finetune:
    cmd: python -m stages.train_finetune
    params:
      params.yaml:
        train:
          epochs: 2
    outs:
    - path: metrics/train_finetune.json
      hash: md5
      md5: 0
"""


def test_metrics_dir_params_come_from_the_locks_not_the_edited_params_yaml(tmp_path, monkeypatch):
    """A quick trial or an edit not yet reproduced changes params.yaml, not the metrics: the table
    shows what the lock files recorded for the stages that wrote them (the default DAG's and the
    fine-tune comparison's), and a key the stages recorded differently (train-finetune not rerun
    since epochs changed) says so."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train_scratch.json").write_text(json.dumps({"val": {"acc_0": 0.5}}))
    (tmp_path / "params.yaml").write_text("vocab:\n  draft_vocab_size: 512\ntrain:\n  epochs: 1\n")
    (tmp_path / "dvc.lock").write_text(LOCK)
    assert lock_params(tmp_path, tmp_path / "metrics") == ({"train.epochs": 4, "vocab.draft_vocab_size": 6144},
                                                          ["dvc.lock"])
    (tmp_path / "finetune").mkdir()
    (tmp_path / "finetune" / "dvc.lock").write_text(FINETUNE_LOCK)
    assert lock_params(tmp_path, tmp_path / "metrics") == (
        {"train.epochs": "mixed: 4 (train-scratch) / 2 (train-finetune)", "vocab.draft_vocab_size": 6144},
        ["dvc.lock", "finetune/dvc.lock"])
    lines = compare_dirs(["metrics"]).splitlines()
    assert "| params file | dvc.lock, finetune/dvc.lock |" in lines
    assert "| `vocab.draft_vocab_size` | 6144 |" in lines  # not params.yaml's 512
    assert "| `train.epochs` | mixed: 4 (train-scratch) / 2 (train-finetune) |" in lines
    assert "| train-scratch val acc_0 | 0.5 |" in lines

    # a directory the locks did not write (a copy elsewhere) keeps the workspace params.yaml
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "train_scratch.json").write_text(json.dumps({"val": {"acc_0": 0.5}}))
    assert lock_params(tmp_path, tmp_path / "other") is None
    lines = compare_dirs(["other"]).splitlines()
    assert "| `vocab.draft_vocab_size` | 512 |" in lines and "| params file | params.yaml |" in lines

    # a lever run's directory brings its own params.yaml (dev/gpu/h200_profile.sh results.tgz): its recipe keys
    (tmp_path / "lever").mkdir()
    (tmp_path / "lever" / "params.yaml").write_text(
        "data:\n  code_packages: [sympy, dvc]\ndistill:\n  max_prompt_tokens: 640\nextract:\n  max_length: 768\n"
        "train:\n  ttt_length: 7\n")
    (tmp_path / "lever" / "train_scratch.json").write_text(json.dumps({"val": {"acc_0": 0.6}}))
    lines = compare_dirs(["other", "lever"]).splitlines()
    assert "| `data.code_packages` | – | sympy, dvc |" in lines
    assert "| `distill.max_prompt_tokens` | – | 640 |" in lines
    assert "| `extract.max_length` | – | 768 |" in lines
    assert "| `train.ttt_length` | – | 7 |" in lines


def test_a_lock_not_in_dvc_layout_is_named(tmp_path):
    (tmp_path / "metrics").mkdir()
    for text in ("- 1\n", "stages:\n  train-scratch: 3\n",
                 "stages:\n  a:\n    outs:\n    - path: metrics/a.json\n    params: [x]\n",
                 "stages:\n  a:\n    outs:\n    - path: null\n"):
        (tmp_path / "dvc.lock").write_text(text)
        with pytest.raises(CompareError, match=rf"^{tmp_path / 'dvc.lock'}: cannot read the params DVC recorded"):
            lock_params(tmp_path, tmp_path / "metrics")


@pytest.mark.parametrize("value, shown", [(True, "yes"), (False, "no"), (None, "unknown")])
def test_a_verdict_is_true_false_or_null(tmp_path, value, shown):
    d = tmp_path / "m"
    d.mkdir()
    (d / "eval_scratch.json").write_text(json.dumps({"chat": {"serving_verdict": {"worth_serving": value}}}))
    lines = compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path).splitlines()
    assert f"| scratch chat worth serving (beats the n-gram floor and greedy) | {shown} |" in lines
    assert "| scratch humaneval worth serving (beats the n-gram floor and greedy) | – |" in lines  # no such key


@pytest.mark.parametrize("value", ["false", 1, 0.5, [], {"x": 1}])
def test_a_verdict_of_another_type_is_named(tmp_path, value):
    """A string "false" is truthy: read as a verdict it would say "yes"."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "eval_scratch.json").write_text(json.dumps({"chat": {"serving_verdict": {"worth_serving": value}}}))
    with pytest.raises(CompareError, match=r"eval_scratch.json: chat.serving_verdict.worth_serving is .*"
                                           r"a verdict is true, false or null"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)


@pytest.mark.parametrize("doc, where", [
    ({"chat": {"serving_verdict": "yes"}}, "chat.serving_verdict is 'yes'"),
    ({"chat": {"serving_verdict": [True]}}, r"chat.serving_verdict is \[True\]"),
    ({"chat": None}, "chat is None"),
    ([{"chat": {"serving_verdict": {"worth_serving": True}}}], "the top level is"),
])
def test_a_verdict_path_through_junk_is_named_not_shown_missing(tmp_path, doc, where):
    """A key that is present but holds the wrong type is junk, not an absent figure (`–`)."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "eval_scratch.json").write_text(json.dumps(doc))
    with pytest.raises(CompareError, match=f"eval_scratch.json: {where}.*expected a mapping"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)


ROW = "served.chat.rows.eagle/chain/T0"


@pytest.mark.parametrize("served, where", [
    ([1, 2], "served is"),
    ({"chat": [1]}, "served.chat is"),
    ({"chat": {"rows": {"eagle/chain/T0": 5}}}, f"{ROW} is 5"),
    ({"chat": {"rows": {"eagle/chain/T0": {"accept_len": 2, "ci95": [1, 2, 3]}}}}, rf"{ROW}.ci95 is \[1, 2, 3\]"),
    ({"chat": {"rows": {"eagle/chain/T0": {"accept_len": 2, "ci95": "ab"}}}}, f"{ROW}.ci95 is 'ab'"),
    ({"chat": {"rows": {"eagle/chain/T0": {"accept_len": "2"}}}}, f"{ROW}.accept_len is '2'"),
])
def test_a_served_table_of_another_layout_is_named(tmp_path, served, where):
    """Was an AttributeError / TypeError traceback, or an interval printed from a string."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "eval_scratch.json").write_text(json.dumps({"served": served}))
    with pytest.raises(CompareError, match=f"eval_scratch.json: {where}"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)


@pytest.mark.parametrize("fname, doc, message", [
    ("train_scratch.json", [1, 2, 3],
     r"train_scratch.json: the top level is \[1, 2, 3\]; expected a mapping \(a metrics file is a JSON object\)"),
    ("train_scratch.json", "0.5", "train_scratch.json: the top level is '0.5'; expected a mapping"),
    ("train_scratch.json", {"val": "abc"}, "train_scratch.json: val is 'abc'; expected a mapping holding 'acc_0'"),
    ("train_scratch.json", {"val": {"acc_0": "abc"}}, "train_scratch.json: val.acc_0 is 'abc'; expected a number"),
    ("train_scratch.json", {"val": {"acc_0": True}}, "train_scratch.json: val.acc_0 is True; expected a number"),
    ("eval_finetune.json", {"chat": {"accept_len": [1.5]}},
     r"eval_finetune.json: chat.accept_len is \[1.5\]; expected a number"),
    ("eval_scratch.json", {"ngram": {"chat": {"accept_len_by_chain_length": {"4": {"x": 1}}}}},
     r"eval_scratch.json: ngram.chat.accept_len_by_chain_length.4 is \{'x': 1\}; expected a number"),
])
def test_a_metrics_file_of_the_wrong_shape_is_named_not_shown_missing(tmp_path, capsys, fname, doc, message):
    """Was: exit 0 and `–`, exactly what an absent file shows. Now one error line naming the
    directory, the file and the key path, exit 2."""
    from eyas.cli import main as cli_main

    d = tmp_path / "m"
    d.mkdir()
    (d / fname).write_text(json.dumps(doc))
    with pytest.raises(CompareError, match=f"^{d}: {message}"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)
    assert cli_main(["compare", "--metrics", str(d)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"eyas compare: error: {d}: {fname}: "), err


@pytest.mark.parametrize("doc, shown", [
    ({"val": {"acc_0": 0.5}}, "0.5"),
    ({"val": {"acc_0": None}}, "–"),  # eyas.io.write_json's NaN
    ({"val": {}}, "–"),               # an older file without the key
    ({"steps": 3}, "–"),
])
def test_a_well_formed_metrics_file_without_the_number_shows_a_dash(tmp_path, doc, shown):
    """The negative control of the test above: the same row, a well-formed file."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "train_scratch.json").write_text(json.dumps(doc))
    lines = compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path).splitlines()
    assert f"| train-scratch val acc_0 | {shown} |" in lines


def test_llama_cpp_served_apart_is_read_from_the_engine_check_file(tmp_path):
    """An eval run with ``serve.engine: none`` has no engine block; benchmarks/engine_check.py writes it to
    engine_<drafter>.json (each benchmark's block at the top). The eval's own block, where there is one, wins."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "eval_scratch.json").write_text(json.dumps({"chat": {"accept_len": 3.7}, "humaneval": {
        "engine": {"same_precision": {"accept_len": 2.5}}}}))
    (d / "engine_scratch.json").write_text(json.dumps({"drafter": "scratch", "chat": {
        "same_precision": {"accept_len": 3.72, "speedup": 0.8}, "quantized": {"accept_len": 3.78}},
        "humaneval": {"same_precision": {"accept_len": 9.0}, "quantized": None}}))  # serve.quantized_target false
    lines = compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path).splitlines()
    assert "| scratch chat accept_len in llama.cpp (same-precision target) | 3.72 |" in lines
    assert "| scratch chat speedup in llama.cpp (same-precision target) | 0.8 |" in lines
    assert "| scratch chat accept_len in llama.cpp (quantized target) | 3.78 |" in lines
    assert "| scratch humaneval accept_len in llama.cpp (same-precision target) | 2.5 |" in lines  # the eval's own
    assert "| finetune chat accept_len in llama.cpp (same-precision target) | – |" in lines
    assert "| scratch humaneval accept_len in llama.cpp (quantized target) | – |" in lines  # a null block
    (d / "engine_scratch.json").unlink()  # the negative control: without the file, a dash
    lines = compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path).splitlines()
    assert "| scratch chat accept_len in llama.cpp (same-precision target) | – |" in lines
    (d / "engine_scratch.json").write_text("[1]")  # a file of the wrong shape is named
    with pytest.raises(CompareError, match="engine_scratch.json: the top level is"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)


def test_an_engine_file_of_another_drafter_or_with_nan_is_refused(tmp_path):
    """engine_<drafter>.json names the drafter llama.cpp served: a file renamed from another drafter's
    would put that drafter's figures in this one's rows. NaN, which Python's json reads and JSON lacks,
    is refused in a metrics file rather than shown as ``nan``; a JSON file compare does not read may hold
    anything."""
    d = tmp_path / "m"
    d.mkdir()
    doc = {"drafter": "scratch", "chat": {"same_precision": {"accept_len": 3.72}}}
    (d / "engine_scratch.json").write_text(json.dumps(doc))
    (d / "notes.json").write_text("NaN")  # not a metrics file: not read
    lines = compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path).splitlines()
    assert "| scratch chat accept_len in llama.cpp (same-precision target) | 3.72 |" in lines
    (d / "engine_finetune.json").write_text(json.dumps(doc))
    with pytest.raises(CompareError, match=r"engine_finetune.json: drafter is \"scratch\", not \"finetune\""):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)
    (d / "engine_finetune.json").unlink()
    for value in ("NaN", "-Infinity", "1e400"):  # 1e400 reads as inf
        (d / "engine_scratch.json").write_text(json.dumps(doc).replace("3.72", value))
        with pytest.raises(CompareError, match=rf"cannot read .*engine_scratch.json: {value} is"):
            compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)
    (d / "engine_scratch.json").write_text(json.dumps({**doc, "drafter": None}))
    with pytest.raises(CompareError, match=r"drafter is null, not \"scratch\""):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)


def test_a_metrics_file_that_cannot_be_read_whole_is_named(tmp_path):
    """A link to a file that is gone is not a missing file (a dash); a FIFO would block the read; a
    document nested past the decoder's recursion is an error, not a traceback. Each names the file."""
    d = tmp_path / "m"
    d.mkdir()
    f = d / "eval_scratch.json"
    f.symlink_to(tmp_path / "gone.json")
    with pytest.raises(CompareError, match=r"eval_scratch.json: a symbolic link to .*gone.json, which leads nowhere"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(CompareError, match=r"eval_scratch.json: not a regular file"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)
    f.unlink()
    f.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CompareError, match=r"eval_scratch.json: nested too deeply"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)
    f.unlink()
    (d / "notes.json").write_text("{}")
    with pytest.raises(CompareError, match=r"m: holds none of the metrics files compare reads \(engine_finetune"):
        compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path)  # nothing it reads there
    f.write_text(json.dumps({"chat": {"accept_len": 3.7}}))  # the negative control: read
    with pytest.raises(CompareError, match=r"eval_scratch.json: not a directory \(give the directory"):
        compare_dirs([str(f)], params_default=tmp_path / "none.yaml", root=tmp_path)  # the file, not its directory
    assert "| scratch chat accept_len | 3.7 |" in compare_dirs([str(d)], params_default=tmp_path / "none.yaml",
                                                              root=tmp_path).splitlines()


def test_an_out_path_that_cannot_be_written_is_one_error_line(tmp_path, capsys):
    """Was: an IsADirectoryError / FileNotFoundError traceback, and a write that was not atomic. Now
    one error line naming the path, exit 2, the table on stdout all the same; a file written is
    replaced whole, with no temporary file left beside it."""
    from eyas.cli import main as cli_main

    d = tmp_path / "m"
    d.mkdir()
    (d / "train_scratch.json").write_text(json.dumps({"val": {"acc_0": 0.5}}))
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    for out, message in ((outdir, f"--out {outdir}: is a directory; name a file (e.g. {outdir / 'compare.md'})"),
                         (blocker / "x.md", f"--out {blocker / 'x.md'}: cannot write the table there: {blocker} "
                                            f"is a file, not a directory")):
        assert cli_main(["compare", "--metrics", str(d), "--out", str(out)]) == 2
        stdout, err = capsys.readouterr()
        assert err == f"eyas compare: error: {message}\n" and "| train-scratch val acc_0 | 0.5 |" in stdout, err
    assert list(outdir.iterdir()) == [] and blocker.read_text() == "x"
    # negative control: a file there is replaced by the table
    target = tmp_path / "reports" / "compare.md"
    target.parent.mkdir()
    target.write_text("old\n")
    assert cli_main(["compare", "--metrics", str(d), "--out", str(target)]) == 0
    stdout, err = capsys.readouterr()
    assert target.read_text() == stdout and err == f"eyas compare: wrote {target}\n"
    assert list(target.parent.iterdir()) == [target]


def test_every_param_that_differs_gets_a_row(tmp_path, monkeypatch):
    """Beyond the recipe keys: a directory whose params differ in extract.aux_layers or eval.top_p shows
    those rows; keys equal in every column only with all_params."""
    monkeypatch.chdir(tmp_path)
    for d, extra in (("a", ""), ("b", "extract:\n  aux_layers: [2, 5, 9]\neval:\n  top_p: 0.5\n")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "params.yaml").write_text("train:\n  epochs: 2\n" + extra)
        (tmp_path / d / "train_scratch.json").write_text(json.dumps({"val": {"acc_0": 0.5}}))
    lines = compare_dirs(["a", "b"]).splitlines()
    assert "| `extract.aux_layers` | – | 2, 5, 9 |" in lines and "| `eval.top_p` | – | 0.5 |" in lines
    assert not [line for line in lines if line.startswith("| `train.warmup_ratio`")]
    assert "| `train.epochs` | 2 | 2 |" in lines  # a recipe key: always its row
    every = compare_dirs(["a", "b"], all_params=True).splitlines()
    assert "| `extract.aux_layers` | – | 2, 5, 9 |" in every


def test_a_flagged_speedup_is_marked(tmp_path):
    """A speedup whose block says ``speedup_flagged: true`` (timed under uneven load: not a result) shows
    ``(flagged)``; false, or no flag at all (files older than the flag), shows the number alone."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "eval_scratch.json").write_text(json.dumps({
        "chat": {"speedup": 9.0, "speedup_flagged": True, "engine": {
            "same_precision": {"speedup": 17.29, "speedup_flagged": True},
            "quantized": {"speedup": 0.9, "speedup_flagged": False}}},
        "humaneval": {"speedup": 1.1, "engine": {"same_precision": {"speedup": 0.7}}}}))
    lines = compare_dirs([str(d)], params_default=tmp_path / "none.yaml", root=tmp_path).splitlines()
    assert "| scratch chat speedup (median) | 9 (flagged) |" in lines
    assert "| scratch chat speedup in llama.cpp (same-precision target) | 17.29 (flagged) |" in lines
    assert "| scratch chat speedup in llama.cpp (quantized target) | 0.9 |" in lines
    assert "| scratch humaneval speedup (median) | 1.1 |" in lines
    assert "| scratch humaneval speedup in llama.cpp (same-precision target) | 0.7 |" in lines
