"""``python -m eyas.pipeline.preset``: ``--write`` changes only what the preset changes and only the file
it should, and each refusal is one line naming the file, key or line at fault. DVC's own parser
(``dvc.utils.serialize.parse_yaml``) and bash are the oracles where the reader is DVC or a shell."""

from __future__ import annotations

import difflib
import os
import subprocess
from pathlib import Path

import pytest
from dvc.utils.hydra import apply_overrides
from dvc.utils.serialize import parse_yaml

from eyas import yaml12
from eyas.pipeline import preset
from eyas.training.params import flatten

ROOT = Path(__file__).resolve().parents[1]

PARAMS = """\
# a head comment
lr: 1.0e-3          # the lr, written with a dot and an exponent

target:
  revision: ~       # pin a sha
  trust_remote_code: True
  gguf_file:
data:
  code_packages: [more_itertools,boltons]   # flow, no spaces
  val: 20           # held out
  test: 40
train: {epochs: 2, batch_tokens: 1024}
eval:
  seeds:
    - 0
    - 1   # the second seed
# a tail comment
"""

PRESET = """\
lr: 1.0e-3             # the same value: its line is kept as written
target:
  revision: abc123
data:
  val: 30
  code_packages: [boltons, '5e-5']
train:
  epochs: 3
  ttt_length: 7
eval:
  seeds: [0, 1, 2]
  chat_prompts: 5
vocab:
  draft_vocab_size: 4096
"""

MERGED = """\
# a head comment
lr: 1.0e-3          # the lr, written with a dot and an exponent

target:
  revision: abc123  # pin a sha
  trust_remote_code: True
  gguf_file:
data:
  code_packages: [boltons, '5e-5']          # flow, no spaces
  val: 30           # held out
  test: 40
train: {epochs: 3, batch_tokens: 1024, ttt_length: 7}
eval:
  seeds:
    [0, 1, 2] # the second seed
  chat_prompts: 5
vocab:
  draft_vocab_size: 4096
# a tail comment
"""


def _files(tmp_path: Path, params: str = PARAMS, pre: str = PRESET) -> tuple[Path, Path]:
    (tmp_path / "params.yaml").write_text(params)
    (tmp_path / "p.yaml").write_text(pre)
    return tmp_path / "params.yaml", tmp_path / "p.yaml"


def test_write_changes_only_the_values_the_preset_changes(tmp_path):
    """Comments, blank lines, key order and the spelling of every untouched value (``1.0e-3``, ``~``,
    ``True``, an empty null, ``[a,b]``) stay; new keys go at the end of their section."""
    params, pre = _files(tmp_path)
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    assert params.read_text() == MERGED
    want = preset.merge(yaml12.load(PARAMS, "p"), yaml12.load(PRESET, "q"), "t")
    assert parse_yaml(MERGED, "params.yaml") == want  # as DVC reads it


def test_the_h200_preset_changes_one_line_per_changed_key_of_the_repo_params(tmp_path):
    before = (ROOT / "params.yaml").read_text()
    params, pre = _files(tmp_path, before, (ROOT / "presets" / "h200.yaml").read_text())
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    after = params.read_text()
    old, new = flatten(yaml12.load(before, "a")), flatten(yaml12.load(after, "b"))
    changed = {k for k in new if k not in old or repr(old[k]) != repr(new[k])}
    assert len(changed) == 31
    lines = {yaml12.key_line(before, k) for k in changed}
    diff = [op for op in difflib.SequenceMatcher(a=before.splitlines(), b=after.splitlines()).get_opcodes()
            if op[0] != "equal"]
    assert all(op[0] == "replace" and op[2] - op[1] == op[4] - op[3] for op in diff)  # no line added or lost
    assert {i + 1 for op in diff for i in range(op[1], op[2])} == lines
    assert parse_yaml(after, "params.yaml") == preset.merge(yaml12.load(before, "a"),
                                                            preset.load_preset(pre), "t")


def test_write_refuses_the_preset_itself_under_any_name(tmp_path, capsys):
    params, pre = _files(tmp_path)
    os.symlink(pre, tmp_path / "link.yaml")
    os.link(pre, tmp_path / "hard.yaml")
    for target in (pre, tmp_path / "link.yaml", tmp_path / "hard.yaml", tmp_path / "x" / ".." / "p.yaml"):
        os.makedirs(tmp_path / "x", exist_ok=True)
        assert preset.main([str(pre), "--params", str(params), "--write", str(target)]) == 2
        assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: --write {target}: is the preset {pre} "
                                           f"itself; write the merged params elsewhere, e.g. --write params.yaml\n")
        assert pre.read_text() == PRESET
    # the negative control: --params and --write the same file, the usual use, still writes
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    assert params.read_text() == MERGED


def test_write_goes_through_a_symbolic_link_to_its_file(tmp_path):
    params, pre = _files(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "params.yaml").write_text(PARAMS)
    link = tmp_path / "params_link.yaml"
    os.symlink("real/params.yaml", link)
    assert preset.main([str(pre), "--params", str(link), "--write", str(link)]) == 0
    assert os.readlink(link) == "real/params.yaml"  # still the link, as it was
    assert (tmp_path / "real" / "params.yaml").read_text() == MERGED
    dangling = tmp_path / "new_link.yaml"  # a link to a file not made yet: made
    os.symlink("real/new.yaml", dangling)
    assert preset.main([str(pre), "--params", str(params), "--write", str(dangling)]) == 0
    assert os.readlink(dangling) == "real/new.yaml" and (tmp_path / "real" / "new.yaml").read_text() == MERGED


def test_write_refuses_what_is_not_a_regular_file(tmp_path, capsys):
    params, pre = _files(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    os.symlink("loop", tmp_path / "loop")
    os.symlink("fifo", tmp_path / "to_fifo")
    (tmp_path / "d").mkdir()
    for target, what in [(tmp_path / "fifo", "a named pipe (FIFO), not a regular file"),
                         (tmp_path / "to_fifo", "a named pipe (FIFO), not a regular file"),
                         ("/dev/null", "a character device, not a regular file"),
                         (tmp_path / "d", "a directory, not a regular file"),
                         (tmp_path / "loop", "a symbolic link that leads back to itself")]:
        assert preset.main([str(pre), "--params", str(params), "--write", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"eyas.pipeline.preset: error: --write {target}: {what}") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "fifo", "loop", "p.yaml", "params.yaml", "to_fifo"]
    assert params.read_text() == PARAMS and list((tmp_path / "d").iterdir()) == []


def test_write_refuses_an_empty_path_and_a_missing_directory(tmp_path, capsys):
    params, pre = _files(tmp_path)
    assert preset.main([str(pre), "--params", str(params), "--write", ""]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == ("eyas.pipeline.preset: error: --write '': give a file path, "
                                         "e.g. --write params.yaml\n")
    target = tmp_path / "no" / "such" / "params.yaml"
    assert preset.main([str(pre), "--params", str(params), "--write", str(target)]) == 2
    assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: --write {target}: no directory "
                                       f"{tmp_path / 'no' / 'such'} to write it in (create it first)\n")
    assert not (tmp_path / "no").exists()
    (tmp_path / "no" / "such").mkdir(parents=True)  # the negative control: the directory there
    assert preset.main([str(pre), "--params", str(params), "--write", str(target)]) == 0
    assert target.read_text() == MERGED


def test_whitespace_is_refused_only_where_it_would_split_an_s_argument(tmp_path, capsys):
    params, pre = _files(tmp_path, pre="target:\n  revision: 'release 1'\n")
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    assert capsys.readouterr().err == f"eyas.pipeline.preset: wrote {params} (1 keys from {pre})\n"
    assert yaml12.load_file(params)["target"]["revision"] == "release 1"
    assert "  revision: release 1 # pin a sha\n" in params.read_text()
    assert preset.main([str(pre), "--params", str(params)]) == 2
    assert capsys.readouterr().err == ("eyas.pipeline.preset: error: preset key 'target.revision': 'release 1' has "
                                       "whitespace: it cannot travel as one -S argument (line 2 of "
                                       f"{pre})\n")


def test_a_section_or_list_given_twice_is_named_not_shown_as_braces(tmp_path, capsys):
    params, pre = _files(tmp_path, pre="train:\n  epochs: 3\ndata:\n  val: 3\ntrain:\n  ttt_length: 7\n")
    assert preset.main([str(pre), "--params", str(params)]) == 2
    assert capsys.readouterr().err == (f'eyas.pipeline.preset: error: {pre}: not valid YAML: found duplicate key '
                                       f'"train" (a section given twice: put all its keys under one) at line 5, '
                                       f'column 1 (while constructing a mapping at line 1)\n')
    pre.write_text("eval:\n  seeds: [0]\n  seeds: [1]\n")
    assert preset.main([str(pre), "--params", str(params)]) == 2
    assert '"seeds" (a list given twice: keep one) at line 3' in capsys.readouterr().err
    pre.write_text("train:\n  epochs: 3\n  epochs: 4\n")  # a scalar's values are real: kept
    assert preset.main([str(pre), "--params", str(params)]) == 2
    assert '"epochs" with value "4" (original value: "3") at line 3' in capsys.readouterr().err


@pytest.mark.parametrize("text, line, nested, then", [
    ("data:\n  val: 3\ntrain.epochs: 3\n", 3, "train:\n  epochs: 3", ""),
    ("train:\n  epochs: 3\n  opt.betas: [0.9, 0.95]\n", 3, "train:\n  opt:\n    betas:\n    - 0.9\n    - 0.95",
     "unknown key 'train.opt'"),
])
def test_a_flat_dotted_key_names_its_line_and_the_nested_form(tmp_path, capsys, text, line, nested, then):
    params, pre = _files(tmp_path, pre=text)
    key = text.splitlines()[line - 1].split(":")[0].strip()
    for args in ([], ["--write", str(tmp_path / "out.yaml")]):
        assert preset.main([str(pre), "--params", str(params), *args]) == 2
        assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: {pre}: line {line}: key '{key}' has a dot "
                                           f"in its name; a preset nests each section's keys:\n{nested}\n")
    assert not (tmp_path / "out.yaml").exists()
    pre.write_text(nested + "\n")  # what the message says to write: past this check, on to the schema's
    assert preset.main([str(pre), "--params", str(params)]) == (2 if then else 0)
    assert then in capsys.readouterr().err


def _shell_words(cwd: Path, line: str) -> list[str]:
    """The words a bash command gets from ``$(printf %s LINE)``: split and globbed, as
    ``dvc exp run $(python -m eyas.pipeline.preset P)`` gets them."""
    out = subprocess.run(["bash", "-c", 'printf "%s\\n" $(printf %s "$1")', "_", line], cwd=cwd,
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_s_words_reach_dvc_through_the_shell_unchanged_or_are_refused(tmp_path, capsys, monkeypatch):
    params, pre = _files(tmp_path, pre="data:\n  code_packages: [boltons, more_itertools]\n")
    monkeypatch.chdir(tmp_path)
    assert preset.main([str(pre), "--params", str(params)]) == 0
    line = capsys.readouterr().out.strip()
    words = _shell_words(tmp_path, line)
    assert words == line.split()  # nothing here for the shell to expand
    apply_overrides(params, words[1::2])
    assert parse_yaml(params.read_text(), "p")["data"]["code_packages"] == ["boltons", "more_itertools"]
    (tmp_path / "data.code_packages=b").write_text("")  # a file name the word's [...] matches
    assert _shell_words(tmp_path, line)[1] == "data.code_packages=b"  # what bash would hand DVC
    assert preset.main([str(pre), "--params", str(params)]) == 2
    assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: preset key 'data.code_packages': the shell "
                                       f"would replace -S {words[1]} with the file data.code_packages=b of this "
                                       f"directory; run it from another directory (line 2 of {pre})\n")
