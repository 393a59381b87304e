"""``python -m eyas.pipeline.preset``: ``--write`` changes only what the preset changes and only the file
it should, and each refusal is one line naming the file, key or line at fault. DVC's own parser
(``dvc.utils.serialize.parse_yaml``) and bash are the oracles where the reader is DVC or a shell."""

from __future__ import annotations

import difflib
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from dvc.utils.hydra import apply_overrides
from dvc.utils.serialize import parse_yaml

from eyas import yaml12
from eyas.params.full import flatten
from eyas.pipeline import preset

ROOT = Path(__file__).resolve().parents[2]

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
  revision: '5e-5'
data:
  val: 30
  code_packages: [boltons, sympy]
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
  revision: '5e-5'  # pin a sha
  trust_remote_code: True
  gguf_file:
data:
  code_packages: [boltons, sympy]           # flow, no spaces
  val: 30           # held out
  test: 40
train: {epochs: 3, batch_tokens: 1024, ttt_length: 7}
eval:
  seeds: [0, 1, 2] # the second seed
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
    assert len(changed) == 33
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
    os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's device, outside /dev (root)
    for target, what in [(tmp_path / "fifo", "a named pipe (FIFO), not a regular file"),
                         (tmp_path / "to_fifo", "a named pipe (FIFO), not a regular file"),
                         (tmp_path / "null", "a character device, not a regular file"),
                         ("/dev/null", "not a params file: under /dev or /proc"),
                         (tmp_path / "d", "a directory, not a regular file"),
                         (tmp_path / "loop", "a symbolic link that leads back to itself")]:
        assert preset.main([str(pre), "--params", str(params), "--write", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"eyas.pipeline.preset: error: --write {target}: {what}") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "fifo", "loop", "null", "p.yaml", "params.yaml",
                                                          "to_fifo"]
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
    capsys.readouterr()
    slash = tmp_path / "new.yaml"  # a trailing slash names a directory: no file new.yaml written
    assert preset.main([str(pre), "--params", str(params), "--write", f"{slash}/"]) == 2
    assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: --write {slash}/: ends in '/', which names a "
                                       f"directory; give a file path, e.g. --write params.yaml\n")
    assert not slash.exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad, why in ((f"{slash}/.", "ends in '.', which names a directory"),
                     (f"{tmp_path}/missing/../new.yaml", f"{tmp_path}/missing/.. is not a directory"),
                     (f"{afile}/../new.yaml", f"{afile}/.. is not a directory")):
        assert preset.main([str(pre), "--params", str(params), "--write", bad]) == 2, bad
        assert capsys.readouterr().err.startswith(f"eyas.pipeline.preset: error: --write {bad}: {why}")
        assert not slash.exists() and afile.read_text() == "x"
    assert preset.main([str(pre), "--params", str(params), "--write", str(slash)]) == 0  # without it: written
    assert slash.read_text() == MERGED


def test_whitespace_is_refused_only_where_it_would_split_an_s_argument(tmp_path, capsys):
    params, pre = _files(tmp_path, pre="target:\n  revision: 'release 1'\n")
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    assert capsys.readouterr().err == f"eyas.pipeline.preset: wrote {params} (1 key from {pre})\n"
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


def _dvc_rewritten(tmp_path: Path) -> Path:
    """The repo's params.yaml after ``dvc exp run -S data.code_packages=[...]`` (the profile's four
    packages, as presets/h200.yaml sets them): DVC writes every list back in block style, its items at
    the key's own indent, the key's comment kept on the key's line."""
    f = tmp_path / "params.yaml"
    f.write_text((ROOT / "params.yaml").read_text())
    apply_overrides(f, ["data.code_packages=[more_itertools,boltons,networkx,sympy]"])
    return f


# presets that replace the list with a shorter and with a longer one wrapped over two lines
LIST_PRESETS = {
    "six": "data:\n  code_prompts: 6800\n  code_packages: [more_itertools, boltons, networkx, sympy, mlflow, dvc]\n",
    "fourteen": ("data:\n  max_conversations: 1840\n  code_prompts: 10700\n"
                 "  code_packages: [more_itertools, boltons, networkx, sympy, mlflow, dvc, dulwich,\n"
                 "                  sqlalchemy, pydantic, rich, jinja2, werkzeug, git, fsspec]\n"),
}


@pytest.mark.parametrize("lever", sorted(LIST_PRESETS))
def test_a_lever_sets_a_list_that_dvc_wrote_in_block_style(tmp_path, lever):
    """The list is replaced whole, from after the key's colon to its last item, on the key's line and
    before the key's comment (its column kept where the value leaves room); no item line is left."""
    f = _dvc_rewritten(tmp_path)
    before = f.read_text()
    key_line = next(line for line in before.splitlines() if line.startswith("  code_packages:"))
    blank = f"{key_line}\n\n  - more_itertools" in before  # DVC (ruamel) puts a blank line there before some keys
    items = "  - more_itertools\n  - boltons\n  - networkx\n  - sympy\n"
    assert f"{key_line}\n{chr(10) * blank}{items}" in before  # DVC's layout
    pre = tmp_path / f"{lever}.yaml"
    pre.write_text(LIST_PRESETS[lever])
    assert preset.main([str(pre), "--params", str(f), "--write", str(f)]) == 0
    after = f.read_text()
    packages = preset.load_preset(pre)["data"]["code_packages"]
    value = f"  code_packages: [{', '.join(packages)}]"
    comment = key_line[key_line.index("#"):]
    assert [line for line in after.splitlines() if line.startswith("  code_packages:")] == [
        value + " " * max(1, key_line.index("#") - len(value)) + comment]
    assert "  - more_itertools" not in after
    assert len(after.splitlines()) == len(before.splitlines()) - 4 - blank  # the items' lines (and a blank one)
    want = preset.merge(parse_yaml(before, "before"), preset.load_preset(pre), "t")
    assert repr(parse_yaml(after, "params.yaml")) == repr(want)  # as DVC reads it, types and order too


SEEDS = "eval:\n  seeds: [5, 6]\n  top_p: 0.5\n"


@pytest.mark.parametrize("before, after", [
    # DVC's style: items at the key's indent; the key's comment and a blank line before the items
    ("eval:\n  seeds:     # the seeds\n\n  - 0\n  - 1\n  top_p: 0.9\nserve:\n  threads: 2\n",
     "eval:\n  seeds: [5, 6] # the seeds\n  top_p: 0.5\nserve:\n  threads: 2\n"),
    # indented items, comments on and between them, a comment line after the list
    ("eval:\n  seeds:\n    - 0   # first\n    # between\n    - 1   # second\n  # after the list\n  top_p: 0.9\n",
     "eval:\n  seeds: [5, 6] # second\n  # after the list\n  top_p: 0.5\n"),
    # an aligned comment after the last item keeps its column
    ("eval:\n  seeds:\n  - 0\n  - 1                      # seeds\n  top_p: 0.9\n",
     "eval:\n  seeds: [5, 6]            # seeds\n  top_p: 0.5\n"),
    # the list last in the file, no final line break; the key added after it
    ("eval:\n  seeds:\n  - 0\n  - 1", "eval:\n  seeds: [5, 6]\n  top_p: 0.5\n"),
])
def test_a_block_list_is_replaced_whole_in_either_indent(tmp_path, before, after):
    params, pre = _files(tmp_path, before, SEEDS)
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    assert params.read_text() == after
    assert parse_yaml(after, "params.yaml")["eval"] == {"seeds": [5, 6], "top_p": 0.5}


def test_a_value_an_alias_shares_is_refused_naming_the_key_and_the_anchor(tmp_path, capsys):
    text = "eval:\n  temperatures: &t\n  - 0\n  - 1\n  top_p: 0.9\ntrain_finetune:\n  lr: 1.0e-4\n"
    params, pre = _files(tmp_path, text.replace("  top_p", "  seeds: *t\n  top_p"), "eval:\n  temperatures: [0.5]\n")
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 2
    assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: {params}: line 2: cannot set 'eval.temperatures' "
                                       f"in place: its value is the anchor &t, which an alias (*t) shares: setting "
                                       f"it would change both; set it by hand (line 2 of {pre})\n")
    assert params.read_text() == text.replace("  top_p", "  seeds: *t\n  top_p")
    params.write_text(text)  # the negative control: the anchor alone (no alias) goes with the list
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    assert params.read_text() == text.replace(" &t\n  - 0\n  - 1\n", " [0.5]\n")


def test_a_text_that_would_not_read_back_is_refused_naming_the_keys(tmp_path, capsys):
    """The read-back check: a kept (|+) block scalar's blank lines are its value, and a key added after
    it would take them; the refusal names the key written and the one it would change."""
    text = "distill:\n  server:\n    model: |+\n      m\n\n\n"
    params, pre = _files(tmp_path, text, "distill:\n  server:\n    timeout: 5.0\n")
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 2
    assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: {params}: cannot set 'distill.server.timeout' in "
                                       f"place: 'distill.server.model' would read back as 'm\\n', not 'm\\n\\n\\n'; "
                                       f"set them by hand (line 3 of {pre})\n")
    assert params.read_text() == text


@pytest.mark.parametrize("before, preset_text, after", [
    ("eval:\n  temperatures: [0.0, 0.7, 1.0]\n", "eval:\n  temperatures: [0, 0.7, 1]\n",
     "eval:\n  temperatures: [0, 0.7, 1]\n"),
    ("eval:\n  temperatures: [0, 0.7, 1]\n", "eval:\n  temperatures: [0.0, 0.7, 1.0]\n",
     "eval:\n  temperatures: [0.0, 0.7, 1.0]\n"),
    ("train:\n  weight_decay: 0.0  # none\n", "train:\n  weight_decay: -0.0\n",
     "train:\n  weight_decay: -0.0  # none\n"),
])
def test_a_value_equal_but_of_another_type_or_sign_is_written(tmp_path, before, preset_text, after):
    """``[0, 0.7, 1] == [0.0, 0.7, 1.0]`` and ``-0.0 == 0.0`` in Python, but DVC reads (and hashes)
    each as written: the preset's form is written, and read back as the preset's."""
    params, pre = _files(tmp_path, before, preset_text)
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    assert params.read_text() == after
    assert repr(parse_yaml(after, "params.yaml")) == repr(parse_yaml(preset_text, "preset"))


def test_crlf_line_endings_are_kept(tmp_path):
    params, pre = _files(tmp_path)
    params.write_bytes(PARAMS.replace("\n", "\r\n").encode())
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    data = params.read_bytes()
    assert data == MERGED.replace("\n", "\r\n").encode()  # added keys and sections too
    assert parse_yaml(data.decode(), "params.yaml") == parse_yaml(MERGED, "params.yaml")


def _write(tmp_path: Path, target: Path) -> int:
    """The preset merged into ``target`` (``--params target --write target``) where it is an existing file, else
    into a new file from tmp_path's params.yaml."""
    params, pre = _files(tmp_path)
    if target.is_file():
        params = target
    return preset.main([str(pre), "--params", str(params), "--write", str(target)])


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664, 0o755])
def test_write_keeps_the_files_mode(tmp_path, mode):
    out = tmp_path / "out.yaml"
    out.write_text(PARAMS)
    out.chmod(mode)
    assert _write(tmp_path, out) == 0
    assert out.read_text() == MERGED and stat.S_IMODE(out.stat().st_mode) == mode


def test_write_refuses_an_existing_file_other_than_params(tmp_path, capsys):
    """Written from --params, the file would lose what it held: refused, untouched; merged into itself it is written."""
    params, pre = _files(tmp_path)
    out = tmp_path / "mine.yaml"
    out.write_text("lr: 0.5  # mine\n")
    assert preset.main([str(pre), "--params", str(params), "--write", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"eyas.pipeline.preset: error: --write {out}: an existing file other than --params {params}: writing would "
        f"replace what it holds with {params} + the preset. Merge into it with --params {out} --write {out}, or "
        f"write a new file\n")
    assert out.read_text() == "lr: 0.5  # mine\n"
    link = tmp_path / "link.yaml"  # the params file under another name is the params file
    link.symlink_to(params)
    assert preset.main([str(pre), "--params", str(params), "--write", str(link)]) == 0
    assert params.read_text() == MERGED
    out.write_text(PARAMS)  # the negative control: merged into itself, written
    assert preset.main([str(pre), "--params", str(out), "--write", str(out)]) == 0 and out.read_text() == MERGED
    empty = tmp_path / "empty.yaml"  # an empty file (touched first) has nothing to lose: written
    empty.touch()
    assert preset.main([str(pre), "--params", str(params), "--write", str(empty)]) == 0
    assert empty.read_text() == params.read_text()


def test_a_bad_value_in_the_params_file_names_its_line_there(tmp_path, capsys):
    """The merged params fail the schema on a value the preset leaves alone: the line is the params file's."""
    params, pre = _files(tmp_path, params=PARAMS.replace("val: 20", "val: -20"), pre="train:\n  epochs: 3\n")
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 2
    err = capsys.readouterr().err
    assert "'data.val'" in err and err.endswith(f" (line 10 of {params})\n"), err
    assert preset.main([str(pre), "--params", str(params)]) == 2  # printing -S args: the same check
    assert capsys.readouterr().err == err
    params.write_text(PARAMS.replace("val: 20", "val: lr"))  # a quoted value is no key: not 'lr' line 2 too
    assert preset.main([str(pre), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "got 'lr'" in err and err.endswith(f" (line 10 of {params})\n"), err
    params.write_text(PARAMS.replace("val: 20", "val: [lr]"))  # nor a quoted item of a list value
    assert preset.main([str(pre), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "got ['lr']" in err and err.endswith(f" (line 10 of {params})\n"), err
    backend = "train:\n  epochs: 2\n  backend:\n    compile: true\n    attention: Flex\n"  # a section's own check
    params, pre = _files(tmp_path, params=backend, pre="train:\n  backend:\n    compile: false\n")
    assert preset.main([str(pre), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "'train.backend.attention'" in err and err.endswith(f" (line 5 of {params})\n"), err
    params.write_text(PARAMS)  # the negative control: a good value there, merged
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0


def test_a_dotted_or_hyphenated_key_is_named_at_its_own_line(tmp_path, capsys):
    """A flat ``train.epochs`` in the params file is named there, not at the preset's nested key of that
    name; an unknown key with a hyphen (``ttt-length``) gets its line too."""
    params, pre = _files(tmp_path, params="lr: 1.0e-3\ntrain.epochs: 4\n", pre="train:\n  epochs: 3\n")
    assert preset.main([str(pre), "--params", str(params)]) == 2
    assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: {params}: line 2: key 'train.epochs' has a "
                                       f"dot in its name; params nest each section's keys:\ntrain:\n  epochs: 4\n")
    # a merge key shifts no key's place
    merged = "train: &t {epochs: 2, eval_every: 10}\nstand_in:\n  <<: *t\n  lr.x: 1\n"
    params, pre = _files(tmp_path, pre=merged)
    assert preset.main([str(pre), "--params", str(params)]) == 2
    assert capsys.readouterr().err.startswith(f"eyas.pipeline.preset: error: {pre}: line 4: key 'lr.x' has a dot")
    params, pre = _files(tmp_path, pre="train:\n  ttt-length: 3\n")
    assert preset.main([str(pre), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "'train.ttt-length'" in err and err.endswith(f" (line 2 of {pre})\n"), err
    params, pre = _files(tmp_path, pre="train:\n  ttt_length: 3\n")  # the negative control: the right key
    assert preset.main([str(pre), "--params", str(params)]) == 0


def test_a_new_file_gets_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        assert _write(tmp_path, tmp_path / "new.yaml") == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.yaml").stat().st_mode) == 0o640


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file another owner takes root")
def test_write_keeps_the_files_owner_and_group(tmp_path):
    out = tmp_path / "out.yaml"
    out.write_text(PARAMS)
    os.chown(out, 1234, 2345)
    out.chmod(0o640)
    assert _write(tmp_path, out) == 0
    st = out.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), out.read_text()) == (1234, 2345, 0o640, MERGED)


@pytest.mark.parametrize("mode", [0o400, 0o444, 0o555])
def test_a_read_only_file_is_refused(tmp_path, capsys, mode):
    """Refused even for root, whom the kernel lets write anything: the mode says the file is not to change."""
    out = tmp_path / "out.yaml"
    out.write_text(PARAMS)
    out.chmod(mode)
    assert _write(tmp_path, out) == 2
    assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: --write {out}: not writable (mode {mode:04o}); "
                                       f"make it writable first (chmod u+w) or write elsewhere\n")
    assert out.read_text() == PARAMS and stat.S_IMODE(out.stat().st_mode) == mode
    out.chmod(mode | 0o200)  # the negative control: writable by its owner, written
    assert _write(tmp_path, out) == 0 and out.read_text() == MERGED


def test_a_file_with_other_hard_links_is_refused(tmp_path, capsys):
    out, other = tmp_path / "out.yaml", tmp_path / "other.yaml"
    out.write_text(PARAMS)
    os.link(out, other)
    assert _write(tmp_path, out) == 2
    assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: --write {out}: one of 2 hard links to one file, "
                                       f"and a new file takes its place: the other names would keep the old params; "
                                       f"give it a file of its own first (cp {out} {out}.new && mv {out}.new {out})\n")
    assert out.read_text() == other.read_text() == PARAMS and out.stat().st_ino == other.stat().st_ino
    other.unlink()  # the negative control: its only name, written
    assert _write(tmp_path, out) == 0 and out.read_text() == MERGED


def test_write_dev_stdout_appended_to_a_log_leaves_the_log_alone(tmp_path):
    """``--write /dev/stdout >> run.log``: /dev/stdout resolves to run.log, which a write would replace."""
    params, pre = _files(tmp_path)
    (tmp_path / "run.log").write_text("the log so far\n")
    cmd = '"$0" -m eyas.pipeline.preset p.yaml --write "$1" >> run.log 2>> run.log'
    r = subprocess.run(["bash", "-c", cmd, sys.executable, "/dev/stdout"], cwd=tmp_path, timeout=120)
    log = (tmp_path / "run.log").read_text()
    assert r.returncode == 2 and log == ("the log so far\neyas.pipeline.preset: error: --write /dev/stdout: not a "
                                         "params file: under /dev or /proc (a device, or a stream of this process "
                                         "such as /dev/stdout); give a file path, e.g. --write params.yaml\n")
    r = subprocess.run(["bash", "-c", cmd, sys.executable, "params.yaml"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and params.read_text() == MERGED  # the negative control: a params file
    assert (tmp_path / "run.log").read_text() == log + "eyas.pipeline.preset: wrote params.yaml (9 keys from p.yaml)\n"


@pytest.mark.parametrize("target, leads", [
    ("/dev/stdout", ""), ("/dev/fd/1", ""), ("/proc/self/fd/1", ""), ("/dev/stderr", ""),
    ("to_stdout.yaml", "it leads to /dev/stdout, "), ("to_log.yaml", "it leads to /proc/self/fd/1, "),
    ("fds/1", "it leads to /proc/"),
])
def test_write_to_a_device_or_a_stream_of_the_process_is_refused_under_any_name(tmp_path, capsys, monkeypatch,
                                                                               target, leads):
    params, pre = _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    os.symlink("/dev/stdout", tmp_path / "to_stdout.yaml")
    os.symlink("/proc/self/fd/1", tmp_path / "to_log.yaml")
    os.symlink("/proc/self/fd", tmp_path / "fds")
    assert preset.main([str(pre), "--params", str(params), "--write", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eyas.pipeline.preset: error: --write {target}: not a params file: {leads}"), err
    assert err.endswith("under /dev or /proc (a device, or a stream of this process such as /dev/stdout); give a "
                        "file path, e.g. --write params.yaml\n") and err.count("\n") == 1, err
    assert params.read_text() == PARAMS


@pytest.mark.parametrize("value, why", [
    ("'???'", "'???' is OmegaConf's missing value: DVC (Hydra) would refuse it"),
    ('"a\\0b"', r"'a\x00b' has a NUL ('\x00'), which no command-line argument holds"),
    ('"\\ud800x"', r"'\ud800x' has a lone surrogate ('\ud800'), which no command-line argument holds"),
])
def test_an_s_value_dvc_cannot_take_is_refused_in_one_encodable_line(tmp_path, capsys, value, why):
    params, pre = _files(tmp_path, pre=f"target:\n  revision: {value}\n")
    assert preset.main([str(pre), "--params", str(params)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.encode("utf-8").decode() == (
        f"eyas.pipeline.preset: error: preset key 'target.revision': {why}"
        + ("" if "OmegaConf" in why else ": it cannot travel as a -S argument") + f" (line 2 of {pre})\n")
    # --write has no argument to pass: the value is written, and DVC reads it back
    assert preset.main([str(pre), "--params", str(params), "--write", str(params)]) == 0
    assert parse_yaml(params.read_text(), "p")["target"]["revision"] == yaml12.load(f"v: {value}", "v")["v"]


@pytest.mark.parametrize("which", ["preset", "params"])
def test_a_yaml_nested_too_deeply_is_one_line(tmp_path, capsys, which):
    deep = "train:\n  epochs: " + "[" * 3000 + "]" * 3000 + "\n"
    params, pre = _files(tmp_path, **{"pre" if which == "preset" else "params": deep})
    for args in ([], ["--write", str(tmp_path / "out.yaml")]):
        assert preset.main([str(pre), "--params", str(params), *args]) == 2
        assert capsys.readouterr().err == (f"eyas.pipeline.preset: error: {pre if which == 'preset' else params}: "
                                           f"nested too deeply to read (more levels than Python's recursion limit)\n")
    assert not (tmp_path / "out.yaml").exists()


def test_a_key_the_params_file_lacks_is_added_with_a_plus(tmp_path, capsys):
    """Hydra refuses ``key=value`` for a key the file lacks ("To append to your config use +key=value");
    PARAMS lacks train.ttt_length, eval.chat_prompts and the vocab section."""
    params, pre = _files(tmp_path)
    assert preset.main([str(pre), "--params", str(params)]) == 0
    words = capsys.readouterr().out.split()
    assert [w for w in words[1::2] if w.startswith("+")] == [
        "+train.ttt_length=7", "+eval.chat_prompts=5", "+vocab.draft_vocab_size=4096"]
    assert words[1::2][:4] == ["lr=0.001", "target.revision='5e-5'", "data.val=30",
                               "data.code_packages=['boltons','sympy']"]
    apply_overrides(params, words[1::2])
    assert parse_yaml(params.read_text(), "p") == preset.merge(yaml12.load(PARAMS, "p"), yaml12.load(PRESET, "q"), "t")


def test_a_preset_and_params_given_as_pipes_are_read_once(tmp_path, capsys):
    """``<(cat f)`` is a pipe: a second read gets nothing. The pipes give what the files give."""
    params, pre = _files(tmp_path)
    run = ["bash", "-c", '"$0" -m eyas.pipeline.preset <(cat p.yaml) --params <(cat params.yaml) "$@"', sys.executable]
    assert preset.main([str(pre), "--params", str(params)]) == 0
    piped = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stdout == capsys.readouterr().out
    piped = subprocess.run([*run, "--write", "out.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and (tmp_path / "out.yaml").read_text() == MERGED
    pre.write_text("train:\n  epochz: 3\n")  # an error names the line of the preset read from the pipe
    piped = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 2 and re.search(r"unknown key 'train\.epochz' .*\(line 2 of /dev/fd/\d+\)\n$",
                                               piped.stderr), piped.stderr


def test_eyas_preset_is_the_module(capsys, tmp_path):
    """`eyas preset` hands its arguments (--help too) to eyas.pipeline.preset, whose `python -m` form stays."""
    from eyas.cli import main

    pre = ROOT / "presets" / "quick.yaml"
    assert main(["preset", str(pre), "--params", str(ROOT / "params.yaml")]) == 0
    via_eyas = capsys.readouterr().out
    assert preset.main([str(pre), "--params", str(ROOT / "params.yaml")]) == 0
    assert capsys.readouterr().out == via_eyas and via_eyas.startswith("-S data.max_conversations=60 ")
    with pytest.raises(SystemExit) as e:
        main(["preset", "--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: eyas preset [-h] [--params PARAMS]")
    r = subprocess.run([sys.executable, "-m", "eyas.cli", "remote", "check", "-C", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and f"{tmp_path}: not a DVC repository" in r.stderr
