"""Bad input gets a clear error naming the file, line or key (before expensive work), and the
safety rules hold: safetensors only, no remote code unless asked, no secrets in MLflow.

Stage scripts run for real in a subprocess where that is cheap (prepare-data reads no model)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from eyas.data.conversations import DataError, load_conversations, split_conversations
from eyas.params.full import ParamsError, load_params

REPO = Path(__file__).resolve().parents[2]


def run_stage(module: str, cwd: Path, params: dict) -> subprocess.CompletedProcess:
    (cwd / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(REPO), "EYAS_TRACKING": "off", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


GOOD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'


# ------------------------------------------------------------------ data and params, as a stage


def test_prepare_data_stage_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD + "\n" + '{"messages": [{"role": "user", "content": "x"}\n' + GOOD + "\n")
    r = run_stage("stages.prepare_data", tmp_path, {"data": {"source": str(bad), "val": 1, "test": 1,
                                                             "publish": 1}})
    assert r.returncode == 1
    # one line, no traceback
    assert r.stderr.startswith(f"prepare-data: error: {bad}:2: malformed JSON: ") and r.stderr.count("\n") == 1
    assert r.stderr.endswith("(set data.on_bad_line: skip to skip such lines)\n")  # the way out is named
    assert not (tmp_path / "data/conversations").exists()  # nothing half-written


def _seed_putting_last(ids: list[str], last: str, n_held_out: int) -> int:
    """A seed whose split order (eyas.data.conversations.split_conversations) puts ``last`` at
    position ``n_held_out - 1``: the last held-out split, written after train, val and test."""
    order = lambda seed: sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())  # noqa: E731
    return next(seed for seed in range(1000) if order(seed).index(last) == n_held_out - 1)


def test_prepare_data_bad_line_keeps_the_previous_run_whole(tmp_path):
    """A lone surrogate in a held-out conversation: one error line naming file, line and id, and
    the previous run's four splits and metrics stay byte for byte (none rewritten)."""
    src = tmp_path / "src.jsonl"
    ids = [f"c{i}" for i in range(8)] + ["sur9"]
    lines = [GOOD.replace('{"messages"', f'{{"id": "{i}", "messages"') for i in ids[:-1]]
    lines.insert(3, '{"id":"sur9","messages":[{"role":"user","content":"bad \\ud800 x"},'
                    '{"role":"assistant","content":"ok"}]}')
    src.write_text("\n".join(lines) + "\n")
    data = {"source": str(src), "val": 1, "test": 1, "publish": 1, "code_prompts": 0, "on_bad_line": "skip"}
    seed = _seed_putting_last(ids, "sur9", 3)
    r = run_stage("stages.prepare_data", tmp_path, {"seed": seed, "data": data})
    assert r.returncode == 0, r.stderr
    outs = [tmp_path / "data/conversations" / f"{s}.jsonl" for s in ("train", "val", "test", "publish")]
    outs.append(tmp_path / "metrics/prepare_data.json")
    before = {f: f.read_bytes() for f in outs}
    assert json.loads(before[outs[-1]])["stats"]["skipped_bad_line"] == 1  # skipped and counted

    r = run_stage("stages.prepare_data", tmp_path, {"seed": seed, "data": {**data, "on_bad_line": "error"}})
    assert r.returncode == 1
    assert r.stderr == (f"prepare-data: error: {src}:4: conversation 'sur9': turn 0 (user): '\\ud800' at "
                        "character 4 is a lone surrogate (an unpaired \\u escape), which UTF-8 cannot encode "
                        "(set data.on_bad_line: skip to skip such lines)\n")
    assert {f: f.read_bytes() for f in outs} == before
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["conversations"]  # no temp dir left


def test_prepare_data_unwritable_split_writes_nothing(tmp_path, monkeypatch):
    """A row the JSONL writer refuses (here injected into publish, the last split written): the
    error names the split file, line and id; no split and no metrics are touched."""
    import stages.prepare_data as stage

    monkeypatch.chdir(tmp_path)
    src = tmp_path / "src.jsonl"
    src.write_text("\n".join(GOOD.replace('{"messages"', f'{{"id": "c{i}", "messages"') for i in range(6)) + "\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(
        {"data": {"source": str(src), "val": 1, "test": 1, "publish": 1, "code_prompts": 0}}))
    outs = [Path("data/conversations") / f"{s}.jsonl" for s in ("train", "val", "test", "publish")]
    outs.append(Path("metrics/prepare_data.json"))
    for f in outs:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("previous run\n")

    def split_with_bad_publish(*args, **kwargs):
        splits = split_conversations(*args, **kwargs)
        splits["publish"].append({"id": "bad", "messages": [{"role": "user", "content": "\udfff"}]})
        return splits

    monkeypatch.setattr(stage, "split_conversations", split_with_bad_publish)
    with pytest.raises(DataError) as e:
        stage.prepare(load_params())
    assert str(e.value) == ("data/conversations/publish.jsonl:2: conversation 'bad': cannot be written as UTF-8 "
                            "JSON: 'utf-8' codec can't encode character '\\udfff' in position 56: surrogates not "
                            "allowed")
    assert {str(f): f.read_text() for f in outs} == {str(f): "previous run\n" for f in outs}


def test_params_errors_name_the_key(tmp_path):
    """A stage checks the sections it reads; identify-inputs, the first stage of every run, the whole file."""
    r = run_stage("stages.prepare_data", tmp_path, {"data": {"lrr": 1.0}})
    assert r.returncode == 1 and r.stderr.startswith("prepare-data: error: params.yaml: unknown key 'data.lrr'")
    assert r.stderr.count("\n") == 1  # one line, no traceback
    r = run_stage("stages.identify_inputs", tmp_path, {"train": {"lrr": 1.0}})
    assert r.returncode == 1 and r.stderr.startswith("identify-inputs: error: params.yaml: unknown key 'train.lrr'")
    assert r.stderr.count("\n") == 1
    (tmp_path / "p.yaml").write_text("extract:\n  max_length: long\n")
    with pytest.raises(ParamsError, match=r"p.yaml: 'extract.max_length' must be an integer, got 'long'"):
        load_params(tmp_path / "p.yaml")
    (tmp_path / "p.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ParamsError, match="p.yaml: not valid YAML"):
        load_params(tmp_path / "p.yaml")
    with pytest.raises(ParamsError, match="nope.yaml: no such params file"):
        load_params(tmp_path / "nope.yaml")


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "robot", "content": "x"}]}', "turn 0: unknown role 'robot'"),
    ('{"conversations": "hi"}', "must be a list"),
    ('[1, 2]', "expected a JSON object, got list"),
    ('{"text": "hi"}', "neither 'messages' (OpenAI) nor 'conversations' (ShareGPT) key"),
    ('{"messages": [{"role": "user", "content": ""}]}', "turn 0 (user): empty text"),
    ('{"id": "x7", "messages": [{"role": "robot", "content": "x"}]}', "conversation 'x7': turn 0: unknown role"),
    # json accepts a lone surrogate escape; UTF-8 cannot write it back: in a text, a ShareGPT value, an id
    ('{"id": "sur9", "messages": [{"role": "user", "content": "bad \\ud800 x"}, '
     '{"role": "assistant", "content": "ok"}]}',
     "conversation 'sur9': turn 0 (user): '\\ud800' at character 4 is a lone surrogate (an unpaired \\u escape), "
     "which UTF-8 cannot encode"),
    ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "\\udfff"}]}',
     "turn 1 (assistant): '\\udfff' at character 0 is a lone surrogate"),
    ('{"id": "a\\udc00", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}',
     "conversation 'a\\udc00': id: '\\udc00' at character 1 is a lone surrogate"),
    # JSON the parser refuses for reasons other than syntax
    pytest.param("[" * 200000 + "]" * 200000, "JSON nested too deeply to parse", id="deep-nesting"),
    pytest.param('{"id": "n", "messages": ' + "1" * 5000 + "}", "JSON not parseable: Exceeds the limit (4300 digits)",
                 id="too-many-digits"),
])
def test_bad_jsonl_lines(tmp_path, line, message):
    f = tmp_path / "d.jsonl"
    f.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(DataError) as e:
        load_conversations(str(f))
    assert f"{f}:2: " in str(e.value) and message in str(e.value)
    convs, stats = load_conversations(str(f), on_bad_line="skip")
    assert len(convs) == 1 and stats["skipped_bad_line"] == 1


def test_non_utf8_and_empty_after_filtering(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(GOOD.encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=re.escape(f"{f}:2: not valid UTF-8")):
        load_conversations(str(f))
    # every conversation lacks an assistant turn: nothing is left, and the stats say why
    f.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n' * 3)
    with pytest.raises(DataError, match=r"no usable conversations .*'skipped_no_assistant': 3"):
        load_conversations(str(f))
    with pytest.raises(DataError, match="no such file"):
        load_conversations(str(tmp_path / "missing.jsonl"))


# ------------------------------------------------------------------ extract: truncation, empty data

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def char_target():
    """The tiny random Llama with a character-level fast tokenizer and a ChatML template."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from eyas.target.model import Target
    from tests.tiny import VOCAB, tiny_target

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    assert len(fast) <= VOCAB
    t = tiny_target()
    return Target(t.model, fast, t.identity)


def _extract(target, convs, out, max_length):
    from eyas.target import layers
    from stages.extract import extract_split, render_split

    p = SimpleNamespace(extract=SimpleNamespace(max_length=max_length, dtype="float32", batch_size=2,
                                                shard_samples=2), train=SimpleNamespace(mode="offline"))
    aux = layers.resolve(None, target.num_layers)
    rendered = render_split(target.tokenizer, convs, out, max_length)
    return extract_split(target, *rendered, out, p, aux, {"aux_layers": aux, "vocab_size": 128})[0]


def _conv(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_extract_counts_truncated_samples(char_target, tmp_path):
    convs = [_conv("hi", "hello"), _conv("a longer question " * 3, "and a long answer " * 4), _conv("q", "ok")]
    m = _extract(char_target, convs, tmp_path / "train", max_length=80)
    assert m["truncated_samples"] == 1 and m["num_samples"] == 3 and m["max_length"] == 80
    assert max(s["tokens"] for s in m["shards"]) <= 2 * 80


def test_extract_empty_after_filtering(char_target, tmp_path):
    # the assistant text lies beyond max_length in every sample: no supervised tokens anywhere
    convs = [_conv("x" * 60, "hello"), _conv("y" * 70, "there")]
    with pytest.raises(ValueError, match="loss mask is all zeros for 2 .* of 2 samples"):
        _extract(char_target, convs, tmp_path / "train", max_length=20)
    with pytest.raises(ValueError, match="train: no samples with assistant tokens"):
        _extract(char_target, [], tmp_path / "train", max_length=20)


# ------------------------------------------------------------------ models, vocab, features


def test_missing_drafter_dir_is_named(tmp_path):
    from eyas.export.load import load_drafter

    with pytest.raises(FileNotFoundError, match=re.escape(f"drafter '{tmp_path / 'nope'}': no such directory")):
        load_drafter(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'half' / 'config.json'}: no such file")):
        load_drafter(tmp_path / "half")


def test_vocab_size_mismatch_between_features_and_vocab_dir(tmp_path):
    from eyas.features import FeatureError, check_compatible
    from eyas.training.loop import new_drafter
    from eyas.vocab.mapping import build_mapping, load_mapping, save_mapping
    from tests.tiny import manifest_fields, tiny_target

    target = tiny_target()
    manifest = manifest_fields(target, [2, 4, 5])
    counts = torch.arange(256, dtype=torch.int64)  # a vocab dir built for a 256-token target
    mapping, info = build_mapping(counts, 32)
    save_mapping(tmp_path / "vocab", mapping, counts, info)
    mapping, _ = load_mapping(tmp_path / "vocab")
    with pytest.raises(FeatureError, match=re.escape(
            f"vocab size mismatch: {tmp_path / 'vocab'} covers 256 target tokens, the features' target has "
            f"vocab_size 128")):
        new_drafter(manifest, mapping, target.head_weights()["embed_tokens"], 0, mapping_source=str(tmp_path / "vocab"))
    with pytest.raises(FeatureError, match="vocab size mismatch: features 128, drafter d 256"):
        check_compatible({**manifest, "aux_layers_convention": "hf_hidden_states_index"}, aux_layers=[2, 4, 5],
                         hidden_size=32, vocab_size=256, source="drafter d")
    with pytest.raises(FeatureError, match=r"aux layer mismatch: .*\[2, 4, 5\] but drafter d expects \[1, 4, 5\]"):
        check_compatible({**manifest, "aux_layers_convention": "hf_hidden_states_index"}, aux_layers=[1, 4, 5],
                         hidden_size=32, vocab_size=128, source="drafter d")


def test_incomplete_features_are_refused(tmp_path):
    from eyas.features import FeatureError, FeatureStore

    (tmp_path / "train").mkdir()
    (tmp_path / "train/shard-00000.safetensors").write_bytes(b"partial")
    with pytest.raises(FeatureError, match="no manifest.json; extraction did not finish"):
        FeatureStore.open(tmp_path / "train")


def test_missing_target_path(tmp_path):
    from eyas.target.model import TargetError, load_target

    with pytest.raises(TargetError, match=re.escape(f"target.path '{tmp_path / 'nope'}': no such directory")):
        load_target(str(tmp_path / "nope"))


# ------------------------------------------------------------------ safety

FORBIDDEN = re.compile(r"torch\.load\(|torch\.save\(|\bimport pickle|\bfrom pickle|\bpickle\.|\bdill\b|joblib|"
                       r"allow_pickle\s*=\s*True|(?<![\w.])eval\(|(?<![\w.])exec\(|marshal\.loads")


def test_no_pickle_eval_or_exec_in_code():
    hits = []
    for d in ("eyas", "stages"):
        for f in sorted((REPO / d).rglob("*.py")):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if FORBIDDEN.search(line):
                    hits.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert not hits, "unsafe deserialisation / code execution:\n" + "\n".join(hits)
    assert FORBIDDEN.search("x = torch.load(p)") and FORBIDDEN.search("eval(s)")
    assert not FORBIDDEN.search("model.eval()") and not FORBIDDEN.search("evaluate(d)")


def test_trust_remote_code_off_unless_asked(tmp_path, monkeypatch):
    import transformers

    from eyas.params.full import default_params
    from eyas.target.model import load_target
    from tests.tiny import tiny_target

    calls = []

    def fake(kind, obj):
        def from_pretrained(path, **kw):
            calls.append((kind, kw))
            return obj
        return from_pretrained

    model = tiny_target().model
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        fake("tokenizer", SimpleNamespace(chat_template="{{ x }}")))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake("model", model))
    assert default_params().target.trust_remote_code is False
    load_target(str(tmp_path), device=torch.device("cpu"))
    assert [(k, kw["trust_remote_code"]) for k, kw in calls] == [("tokenizer", False), ("model", False)]
    calls.clear()
    load_target(str(tmp_path), trust_remote_code=True, device=torch.device("cpu"))
    assert [kw["trust_remote_code"] for _, kw in calls] == [True, True]
    # the extract stage passes the param through (not a hard-coded True)
    src = (REPO / "stages/extract.py").read_text()
    assert "p.target.trust_remote_code" in src and "trust_remote_code=True" not in src


def test_secrets_not_logged(monkeypatch):
    from eyas.tracking.runs import MASK, MlflowTracker, redact

    logged = []

    class Client:
        def log_batch(self, run_id, metrics=(), params=(), tags=()):
            logged.extend([*params, *tags])

    monkeypatch.setenv("HF_TOKEN", "hf_envsecret")
    t = MlflowTracker(Client(), "run")
    t.log_params({"target": {"path": "org/model", "hf_token": "hf_abc"}, "train": {"batch_tokens": 2048},
                  "remote": {"api_key": "sk-123", "password": "hunter2"}})
    t.set_tags({"aws_secret_access_key": "AKIA/xyz", "note": "ok"})
    values = {x.key: x.value for x in logged}
    assert values["target.hf_token"] == MASK and values["remote.api_key"] == MASK
    assert values["remote.password"] == MASK and values["aws_secret_access_key"] == MASK
    assert values["train.batch_tokens"] == "2048" and values["target.path"] == "org/model"
    assert values["note"] == "ok"
    assert not any(s in v for v in values.values() for s in ("hf_abc", "sk-123", "hunter2", "AKIA", "hf_envsecret"))
    assert redact({"HF_TOKEN": "x", "max_new_tokens": 5}) == {"HF_TOKEN": MASK, "max_new_tokens": 5}
