"""Params files read as DVC reads them: every scalar on which YAML 1.1 (PyYAML) and YAML 1.2 (DVC's
ruamel.yaml) disagree gets DVC's value in the stage's typed params, in a preset, in ``eyas.pipeline.preset
--write`` and in ``train.nproc``; DVC's own parser (``dvc.utils.serialize.parse_yaml``) is the oracle."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest
import yaml
from dvc.utils.serialize import parse_yaml

from eyas import yaml12
from eyas.params.full import ParamsError, load_params
from eyas.pipeline import preset
from eyas.training import launch

ROOT = Path(__file__).resolve().parents[1]

# text -> (DVC's value, PyYAML's value): each row is a scalar the two readings disagree on
DISAGREE = {
    "050": (50, 40),             # YAML 1.1 octal
    "5e-5": (5e-5, "5e-5"),      # YAML 1.1 needs a dot in a float
    "0o12": (10, "0o12"),        # YAML 1.2 octal
    "1:30": ("1:30", 90),        # YAML 1.1 base 60
    "on": ("on", True),          # YAML 1.1 boolean
}


@pytest.mark.parametrize("text", DISAGREE)
def test_the_disagreements_are_real_and_eyas_takes_dvcs_side(text):
    dvc_value, pyyaml_value = DISAGREE[text]
    doc = f"k: {text}\n"
    assert yaml.safe_load(doc)["k"] == pyyaml_value  # the reading eyas used to make
    assert parse_yaml(doc, "params.yaml")["k"] == dvc_value
    assert yaml12.load(doc, "params.yaml")["k"] == dvc_value
    assert yaml12.load(yaml12.dump({"k": dvc_value}), "dumped") == {"k": dvc_value}
    assert parse_yaml(yaml12.dump({"k": dvc_value}), "dumped") == {"k": dvc_value}


def test_a_stage_runs_with_the_values_dvc_hashed(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("lr: 5e-5\ndata:\n  max_conversations: 0240\neval:\n  max_new_tokens: 0o20\n")
    dvc_view = parse_yaml(f.read_text(), str(f))
    p = load_params(f)
    assert (p.lr, p.data.max_conversations, p.eval.max_new_tokens) == (5e-5, 240, 16)
    d = dvc_view
    assert (d["lr"], d["data"]["max_conversations"], d["eval"]["max_new_tokens"]) == (5e-5, 240, 16)


def test_a_duplicate_key_is_refused_with_its_line(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("lr: 1.0e-4\ntrain:\n  epochs: 2\n  epochs: 3\n")  # PyYAML keeps 3 silently
    assert yaml.safe_load(f.read_text())["train"]["epochs"] == 3
    with pytest.raises(ParamsError, match=rf"(?s)^{f}: not valid YAML: .*duplicate key \"epochs\".*line 4"):
        load_params(f)


def test_a_section_or_list_given_twice_is_named_as_such(tmp_path):
    """ruamel.yaml shows a repeated section's value as "{}" (not built yet): every reader says what it is."""
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  lr: 1\ntrain:\n  epochs: 2\n")
    with pytest.raises(ParamsError) as e:
        load_params(f)
    assert str(e.value) == (f'{f}: not valid YAML: found duplicate key "train" (a section given twice: put all its '
                            'keys under one) at line 3, column 1 (while constructing a mapping at line 1)')
    f.write_text("eval:\n  seeds: [0]\n  seeds: [1]\n")
    with pytest.raises(ParamsError, match=r'duplicate key "seeds" \(a list given twice: keep one\) at line 3'):
        load_params(f)


def test_a_preset_and_its_written_params_keep_dvcs_values(tmp_path):
    base = tmp_path / "params.yaml"
    base.write_text((ROOT / "params.yaml").read_text())
    pre = tmp_path / "p.yaml"
    pre.write_text("data:\n  max_conversations: 0300\ntrain:\n  epochs: 0o3\n")
    assert preset.load_preset(pre) == {"data": {"max_conversations": 300}, "train": {"epochs": 3}}
    out = tmp_path / "merged.yaml"
    assert preset.main([str(pre), "--params", str(base), "--write", str(out)]) == 0
    p = load_params(out)
    assert (p.data.max_conversations, p.train.epochs) == (300, 3)
    assert parse_yaml(out.read_text(), str(out))["data"]["max_conversations"] == 300


def test_nproc_is_read_as_dvc_reads_it(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  nproc: 010\n")
    assert launch.nproc_from_params(f) == 10 == parse_yaml(f.read_text(), str(f))["train"]["nproc"]


# text -> the message's file, line and cause: every way a params file can fail to load names them
# (ruamel.yaml raises ValueError/TypeError/KeyError without a line for some scalars; DVC reads UTF-8)
UNREADABLE = {
    "a: 1\nb:\n  c: [1, 2]\n  d: 2026-13-45\n": r"month must be in 1\.\.12 at line 4, column 6",
    "a: 1\nb: !!int x\n": r"invalid literal for int.* at line 2, column 4",
    "a: 1\nb: !!bool x\n": r"KeyError: 'x' at line 2, column 4",
    "a: 1\n? [a, [b]]\n: 1\n": r"unhashable type: 'list' at line 1, column 1",
    "a: 1\ntrain:\n  epochs: 2\n  epochs: 3\n": r"duplicate key \"epochs\".* at line 4, column 3 "
                                               r"\(while constructing a mapping at line 3\)$",
    "a: 1\n---\nb: 2\n": r"but found another document at line 2, column 1",
    "train:\n\tepochs: 2\n": r"found character '\\t' that cannot start any token at line 2, column 1",
    "a: 1\r\nb: caf\xe9\r\n": r"not UTF-8 text \(DVC reads params as UTF-8\): byte 0xe9 at line 2$",
}


@pytest.mark.parametrize("text", UNREADABLE)
def test_an_unreadable_params_file_is_refused_naming_the_file_and_line(tmp_path, text):
    f = tmp_path / "params.yaml"
    f.write_bytes(text.encode("latin-1"))
    with pytest.raises(ParamsError, match=rf"(?s)^{f}: .*{UNREADABLE[text]}") as e:
        load_params(f)
    assert "suppress" not in str(e.value)  # ruamel.yaml's advice to turn the duplicate check off
    with pytest.raises(yaml12.YamlError, match=UNREADABLE[text]):
        yaml12.load_file(f)


@pytest.mark.parametrize("text, value, kind", [
    ("2026-12-01", "datetime.date(2026, 12, 1)", "date"),
    ("12345e7", "123450000000.0", "float"),   # a short commit sha of digits and one e
    ("0123456", "123456", "int"),              # and one of digits: leading zeros dropped
    ("!!binary aGk=", "b'hi'", "bytes"),
])
def test_a_string_param_yaml_reads_as_another_type_says_to_quote_it(tmp_path, text, value, kind):
    f = tmp_path / "params.yaml"
    f.write_text(f"target:\n  revision: {text}\n")
    assert repr(parse_yaml(f.read_text(), str(f))["target"]["revision"]) == value  # DVC's reading too
    with pytest.raises(ParamsError, match=rf"^{f}: 'target.revision' must be a string, got {re.escape(value)} "
                                          rf"\(YAML reads it as {kind}: write it in quotes\) "
                                          r"\(line 2 of params\.yaml\)$"):
        load_params(f)
    f.write_text(f"target:\n  revision: '{text}'\n")
    assert load_params(f).target.revision == text


def test_keys_of_several_yaml_types_are_named_as_unknown_not_a_crash(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  1: a\n  2026-12-01: b\n  ~: c\n")
    with pytest.raises(ParamsError, match=r"unknown key 'train\.1', 'train\.2026-12-01', 'train\.None'"):
        load_params(f)


def _dvc_set(params: Path, args: list[str]) -> dict:
    """``params`` after DVC applies ``-S`` arguments (what ``dvc exp run -S`` writes before a run),
    read back by DVC's own parser."""
    from dvc.utils.hydra import apply_overrides

    apply_overrides(params, args[1::2])
    return parse_yaml(params.read_text(), str(params))


def test_the_repo_presets_reach_dvc_as_eyas_checked_them(tmp_path):
    for pre in sorted((ROOT / "presets").glob("*.yaml")):
        base = tmp_path / "params.yaml"
        base.write_text((ROOT / "params.yaml").read_text())
        merged = preset.merge(yaml12.load_file(base), preset.load_preset(pre), pre.name)
        assert _dvc_set(base, preset.set_args(preset.load_preset(pre))) == merged, pre.name


# strings Hydra (DVC's -S parser) reads as another type or as syntax when unquoted, or that PyYAML's
# flow style escapes in a way Hydra does not undo (é became the 4 characters \xE9)
TRICKY_STRINGS = ["12345e7", "1e3", "nan", "inf", "nUll", "tRue", "yes", "a,b", "a=b", "it's", "x\\", "x\\'y",
                  "é", "0o12", "2026-12-01", "", "[a]"]


@pytest.mark.parametrize("value", TRICKY_STRINGS)
def test_a_preset_string_reaches_dvc_as_that_string(tmp_path, value):
    f = tmp_path / "params.yaml"
    f.write_text("target:\n  revision: main\n")
    args = preset.set_args({"target": {"revision": value}})
    assert _dvc_set(f, args) == {"target": {"revision": value}}, args


@pytest.mark.parametrize("value", [5e-05, 1e-07, 1e16, -0.0, 3, True, None, [0, 1, 2], ["train", "yes"]])
def test_a_preset_number_bool_null_or_list_reaches_dvc_as_that_value(tmp_path, value):
    f = tmp_path / "params.yaml"
    f.write_text("k: placeholder\n")
    got = _dvc_set(f, preset.set_args({"k": value}))["k"]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("value, why", [("a b", "has whitespace"), ("${x}", r"DVC \(Hydra\) would interpolate it"),
                                        (datetime.date(2026, 12, 1), "has no dvc exp run -S form")])
def test_a_preset_value_that_cannot_travel_as_one_s_argument_is_refused_naming_the_key(value, why):
    with pytest.raises(ParamsError, match=rf"^preset key 'target\.revision': .*{why}"):
        preset.set_args({"target": {"revision": value}})


@pytest.mark.parametrize("text, message", [
    ("train:\n  nproc: auto\n", r"'train\.nproc' must be an integer \(0 = one per CUDA device\), got 'auto'"),
    ("train:\n  nproc: '8'\n", r"'train\.nproc' must be an integer \(0 = one per CUDA device\), got '8'"),
    ("train:\n  nproc: ~\n", r"'train\.nproc' must be an integer \(0 = one per CUDA device\), got None"),
    ("train: [1]\n", r"'train' must be a mapping, got \[1\]"),
    ("- 1\n", r"the top level must be a mapping, got \[1\]"),
    ("train:\n  nproc: 2\ntrain:\n  nproc: 3\n", r"not valid YAML: found duplicate key \"train\".* at line 3"),
])
def test_launch_refuses_an_nproc_the_stage_would_refuse_before_starting_processes(tmp_path, text, message):
    f = tmp_path / "params.yaml"
    f.write_text(text)
    with pytest.raises(ParamsError):  # what the stage, under torchrun, would then say in every rank
        load_params(f)
    with pytest.raises(ValueError, match=rf"^{f}: {message}"):
        launch.nproc_from_params(f)


@pytest.mark.parametrize("name, data, message", [
    ("params.yaml", b"train:\n  epochs: 2\ntrain:\n  epochs: 3\n",
     r"cannot read its params: {p}: not valid YAML: found duplicate key \"train\".* at line 3"),
    ("params.yaml", b"hello\n", r"cannot read its params: {p}: the top level must be a mapping"),
    ("params.yaml", b"- 1\n", r"cannot read its params: {p}: the top level must be a mapping"),
    ("params.yaml", b"lr: caf\xe9\n", r"cannot read its params: {p}: not UTF-8 text .* at line 1"),
    ("eval_scratch.json", b'{"a": 1,}', r"cannot read {p}: Expecting property name"),
    ("eval_scratch.json", b'{"a": "\xe9"}', r"cannot read {p}: 'utf-8' codec can't decode byte 0xe9"),
])
def test_compare_metrics_names_the_broken_file_beside_the_metrics(tmp_path, name, data, message):
    from eyas.tracking.compare import CompareError
    from eyas.tracking.compare_dirs import compare_dirs

    d = tmp_path / "m"
    d.mkdir()
    (d / "train_scratch.json").write_text('{"val": {"acc_0": 0.5}}')
    (d / name).write_bytes(data)
    with pytest.raises(CompareError, match=rf"(?s)^{d}: " + message.format(p=re.escape(str(d / name)))):
        compare_dirs([str(d)])


def test_preset_write_changes_for_dvc_only_the_keys_the_preset_sets(tmp_path):
    import json
    import subprocess

    def sh(*cmd):
        return subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True, text=True, timeout=120).stdout

    sh("git", "init", "-q")
    sh("dvc", "init", "-q")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (tmp_path / "dvc.yaml").write_text("stages:\n  s:\n    cmd: echo\n    params: [lr, train, data]\n")
    sh("git", "add", "-A")
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "params")
    base = parse_yaml((tmp_path / "params.yaml").read_text(), "params.yaml")
    pre = tmp_path / "p.yaml"
    pre.write_text("lr: 5e-5\ntrain:\n  epochs: 0o7\n  nproc: 1_0\ndata:\n  max_conversations: 0400\n")
    f = tmp_path / "params.yaml"
    assert preset.main([str(pre), "--params", str(f), "--write", str(f)]) == 0
    diff = json.loads(sh("dvc", "params", "diff", "--json"))["params.yaml"]
    assert {k: (v["old"], v["new"]) for k, v in diff.items()} == {
        "lr": (base["lr"], 5e-5), "train.epochs": (base["train"]["epochs"], 7),
        "train.nproc": (base["train"]["nproc"], 10), "data.max_conversations": (base["data"]["max_conversations"], 400)}
    p = load_params(f)
    assert (p.lr, p.train.epochs, p.train.nproc, p.data.max_conversations) == (5e-5, 7, 10, 400)


@pytest.mark.parametrize("text, message", [
    ("a: 1\na: 2\n", r"not valid YAML: found duplicate key \"a\".* at line 2, column 1"),
    ("- 1\n", r"a params file is a mapping of params sections, got list"),
    (None, r"no such params file"),
])
def test_preset_names_a_broken_params_file_it_merges_into(tmp_path, capsys, text, message):
    f = tmp_path / "params.yaml"
    if text is not None:
        f.write_text(text)
    pre = tmp_path / "p.yaml"
    pre.write_text("train:\n  epochs: 3\n")
    assert preset.main([str(pre), "--params", str(f), "--write", str(tmp_path / "out.yaml")]) == 2
    assert re.match(rf"^eyas\.pipeline\.preset: error: {f}: {message}", capsys.readouterr().err)
    assert not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize("text, message", [
    ("lr: 3.0e-4\ntrain:\n  epochs: x\n", r"'train\.epochs' must be an integer, got 'x' \(line 3 of params\.yaml\)$"),
    ("eval:\n  seeds:\n    - 0\n    - x\n",
     r"'eval\.seeds\[1\]' must be an integer, got 'x' \(line 4 of params\.yaml\)$"),
    ("lr: 2\n", r"'lr' must be in \(0, 1\), got 2\.0 \(line 1 of params\.yaml\)$"),
    ("\n\ntrain:\n  lrr: 1\n", r"unknown key 'train\.lrr' \(allowed: .*\) \(line 4 of params\.yaml\)$"),
    ("target:\n  revision: 2026-12-01\n", r"'target\.revision' must be a string, .* \(line 2 of params\.yaml\)$"),
    ("seed: 0\n~: 1\n", r"unknown key 'None' \(allowed: .*\) \(line 2 of params\.yaml\)$"),  # the key as loaded
    ("seed: 0\ntrue: 1\n", r"unknown key 'True' \(allowed: .*\) \(line 2 of params\.yaml\)$"),
    ("distill:\n  max_new_tokens: 64\nextract:\n  max_length: 50\n",  # two keys: the line of each
     r"'distill\.max_new_tokens' \(64\) must be < 'extract\.max_length' \(50\): .* "
     r"\('distill\.max_new_tokens' line 2, 'extract\.max_length' line 4 of params\.yaml\)$"),
    ("extract:\n  max_length: 50\n",  # one of the two set here: its line
     r"'distill\.max_new_tokens' \(64\) must be < 'extract\.max_length' \(50\): .* \(line 2 of params\.yaml\)$"),
])
def test_a_params_error_names_the_line_that_sets_the_key(tmp_path, text, message):
    f = tmp_path / "params.yaml"
    f.write_text(text)
    with pytest.raises(ParamsError, match=rf"^{f}: {message}"):
        load_params(f)


@pytest.mark.parametrize("text, message", [
    ("data:\n  val: 3\ntrain:\n  epochs: x\n", r"'train\.epochs' must be an integer, got 'x'"),
    ("data:\n  val: 3\ntrain:\n  epochz: 2\n", r"unknown key 'train\.epochz' \(allowed: .*\)"),
    ("data:\n  val: 3\ntarget:\n  revision: 'a b'\n", r"preset key 'target\.revision': 'a b' has whitespace.*"),
])
def test_a_preset_error_names_the_presets_line(tmp_path, capsys, text, message):
    base = tmp_path / "params.yaml"
    base.write_text((ROOT / "params.yaml").read_text())
    pre = tmp_path / "p.yaml"
    pre.write_text(text)
    assert preset.main([str(pre), "--params", str(base)]) == 2
    err = capsys.readouterr().err.strip()
    assert re.match(rf"^eyas\.pipeline\.preset: error: .*{message} \(line 4 of {pre}\)$", err)


@pytest.mark.parametrize("which", ["preset", "params", "write"])
def test_a_directory_where_a_file_belongs_is_refused_naming_it(tmp_path, capsys, which):
    """A directory given as the preset, the params file or --write: one error line naming the path
    (was: an IsADirectoryError traceback); the negative control, real files, exits 0 and writes."""
    base = tmp_path / "params.yaml"
    base.write_text((ROOT / "params.yaml").read_text())
    pre = tmp_path / "p.yaml"
    pre.write_text("train:\n  epochs: 3\n")
    d = tmp_path / "adir"
    d.mkdir()
    out = tmp_path / "out.yaml"
    args = {"preset": [str(d), "--params", str(base), "--write", str(out)],
            "params": [str(pre), "--params", str(d), "--write", str(out)],
            "write": [str(pre), "--params", str(base), "--write", str(d)]}[which]
    assert preset.main(args) == 2
    err = capsys.readouterr().err
    assert re.match(rf"^eyas\.pipeline\.preset: error: (--write )?{d}: .*directory", err), err
    assert not out.exists() and list(d.iterdir()) == []
    assert preset.main([str(pre), "--params", str(base), "--write", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["train"]["epochs"] == 3


@pytest.mark.parametrize("name", ["quick", "llama-3.1-8b-instruct", "qwen3-8b", "h200"])
def test_every_repo_preset_passes_the_schema(name, capsys):
    assert preset.main([str(ROOT / "presets" / f"{name}.yaml"), "--params", str(ROOT / "params.yaml")]) == 0
    assert capsys.readouterr().out.startswith("-S ")


@pytest.mark.parametrize("text, good, message", [
    ("distill:\n  max_prompt_tokens: 300\n", "distill:\n  max_prompt_tokens: 256\n",
     r"'distill\.max_prompt_tokens' \(300\) \+ 'distill\.max_new_tokens' \(64\) must be <= 'extract\.max_length' "
     r"\(320\): extract would cut the target's reply off"),
    ("data:\n  max_conversations: 50\n", "data:\n  max_conversations: 141\n",
     r"'data\.max_conversations' \(50\) must be > 'data\.val' \+ 'data\.test' \+ 'data\.publish' "
     r"\(20 \+ 40 \+ 80 = 140\): no conversation would be left to train on"),
    ("target:\n  gguf_file: x.gguf\n", "target:\n  path: some/dir\n  gguf_file: x.gguf\n",
     r"'target\.gguf_file' must be null when 'target\.path' is 'embedded' .*got 'x\.gguf'"),
])
def test_params_that_contradict_each_other_are_refused_naming_both(tmp_path, text, good, message):
    """Keys each valid alone but not together fail at load, before any compute, with the line of the
    key this file sets; the negative control (the nearest consistent value) loads."""
    f = tmp_path / "params.yaml"
    f.write_text(text)
    with pytest.raises(ParamsError, match=rf"^{f}: {message}.*\(line [12] of params\.yaml\)$"):
        load_params(f)
    f.write_text(good)
    load_params(f)


@pytest.mark.parametrize("text", ["train: {}\n", "train:\n  {}\ndata: {}\n"])
def test_a_preset_that_sets_nothing_is_refused(tmp_path, capsys, text):
    """``dvc exp run $(python -m eyas.pipeline.preset P)`` with an empty override list would run the
    defaults under the preset's name; the negative control sets one key and passes."""
    base = tmp_path / "params.yaml"
    base.write_text((ROOT / "params.yaml").read_text())
    pre = tmp_path / "p.yaml"
    pre.write_text(text)
    assert preset.main([str(pre), "--params", str(base)]) == 2
    assert capsys.readouterr().err.strip() == (f"eyas.pipeline.preset: error: {pre}: a preset sets at least one key, "
                                               f"got only empty sections")
    pre.write_text("train:\n  epochs: 3\n")
    assert preset.main([str(pre), "--params", str(base)]) == 0
