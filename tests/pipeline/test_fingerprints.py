"""Fingerprints checked at load (eyas/pipeline/provenance.py), and the params-file readings DVC and eyas share.

A workspace with tiny features whose manifests carry extract's fingerprint; the real build-vocab
stage writes models/vocab; then the stages that read them run on their own (as `dvc repro -s` or
`python -m stages.X` would) after one input changed, and must refuse, naming the stage to rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eyas.io import save_safetensors
from eyas.params.full import ParamsError, load_params
from eyas.pipeline import provenance
from eyas.pipeline.provenance import StaleError
from tests.tiny import tiny_target, write_features

REPO = Path(__file__).resolve().parents[2]
PARAMS = {"seed": 0, "target": {"path": "./target"}, "vocab": {"draft_vocab_size": 16},
          "train": {"ttt_length": 2, "batch_tokens": 48, "epochs": 1, "eval_every": 5}}


@pytest.fixture
def ws(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EYAS_TRACKING", "off")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    (tmp_path / "target").mkdir()
    for f in ("config.json", "tokenizer.json", "chat_template.jinja"):
        (tmp_path / "target" / f).write_text(f"{f} v1\n")
    (tmp_path / "data/distilled").mkdir(parents=True)
    for s in ("train", "val", "publish"):
        (tmp_path / f"data/distilled/{s}.jsonl").write_text(f'{{"split": "{s}"}}\n')
    p = load_params()
    fp = provenance.record("extract", p, [f"data/distilled/{s}.jsonl" for s in ("train", "val", "publish")])
    target = tiny_target()
    for split, n, seed in (("train", 12, 1), ("val", 4, 2)):
        write_features(target, tmp_path / "data/features" / split, n, seed=seed)
        m = tmp_path / "data/features" / split / "manifest.json"
        m.write_text(json.dumps({**json.loads(m.read_text()), "fingerprint": fp}))
    save_safetensors(target.head_weights(), tmp_path / "data/features/target_head.safetensors")
    from stages import build_vocab

    build_vocab.main()
    assert json.loads((tmp_path / "models/vocab/vocab.json").read_text())["fingerprint"]["stage"] == "build-vocab"
    return tmp_path


def _train_scratch():
    from stages import train_scratch

    train_scratch.main()


def _set(path: Path, key: str, value) -> None:
    p = yaml.safe_load(path.read_text())
    node = p
    *parents, last = key.split(".")
    for k in parents:
        node = node.setdefault(k, {})
    node[last] = value
    path.write_text(yaml.safe_dump(p))


def test_vocab_built_with_other_params_is_refused(ws):
    """params say draft_vocab_size 32, models/vocab holds 16 entries (built with 16)."""
    _set(ws / "params.yaml", "vocab.draft_vocab_size", 32)
    with pytest.raises(StaleError) as e:
        _train_scratch()
    msg = str(e.value)
    assert "models/vocab was built by build-vocab with vocab.draft_vocab_size = 16" in msg
    assert "now has vocab.draft_vocab_size = 32" in msg and "dvc repro build-vocab" in msg


def test_vocab_from_older_features_is_refused(ws):
    """The train features changed (re-extracted) and build-vocab did not rerun."""
    m = ws / "data/features/train/manifest.json"
    m.write_text(json.dumps({**json.loads(m.read_text()), "truncated_samples": 99}))
    with pytest.raises(StaleError, match=r"data/features/train changed since build-vocab built models/vocab.*"
                                         r"dvc repro build-vocab"):
        _train_scratch()


def test_features_of_another_chat_template_are_refused(ws):
    (ws / "target/chat_template.jinja").write_text("a new template\n")
    from stages import build_vocab

    with pytest.raises(StaleError, match=r"built by extract for another target \(chat_template.jinja changed\)"
                                         r".*dvc repro extract"):
        build_vocab.main()


def test_features_from_older_distilled_data_are_refused(ws):
    (ws / "data/distilled/train.jsonl").write_text('{"split": "train", "new": 1}\n')
    with pytest.raises(StaleError, match=r"data/distilled/train.jsonl changed since extract"):
        _train_scratch()


def test_drafter_fingerprint_is_checked(ws):
    """An exported drafter records its stage's params; a reader (eval) refuses other values."""
    d = ws / "models/scratch"
    d.mkdir(parents=True)
    p = load_params()
    (d / provenance.FILE).write_text(json.dumps(provenance.record("train-scratch", p, ["models/vocab"])))
    provenance.check(d, p, reader="eval-accept-len@scratch")  # unchanged: fine
    p.train.nproc = 4  # ignored: how it runs, not what it writes
    provenance.check(d, p, reader="eval-accept-len@scratch")
    p.train.epochs = 3
    with pytest.raises(StaleError, match=r"train.epochs = 1.*train.epochs = 3.*dvc repro train-scratch"):
        provenance.check(d, p, reader="eval-accept-len@scratch")


def test_artifact_without_fingerprint_is_not_checked(ws, caplog):
    shutil.rmtree(ws / "models/vocab")
    (ws / "models/vocab").mkdir()
    provenance.check(ws / "models/vocab", load_params(), reader="x")
    assert "no fingerprint" in caplog.text


def _distill_in(ws: Path, **distill) -> dict:
    """self-distill, the real stage code (stages/self_distill.run), on data/conversations with a tiny
    target and a stub tokenizer (tests/data/test_distill.py) standing in for ./target's weights; returns
    its metrics."""
    from eyas.data.conversations import write_jsonl
    from stages import self_distill
    from tests.data.test_distill import _conversations, _stub_target

    for split in ("train", "val", "publish", "test"):
        write_jsonl(ws / f"data/conversations/{split}.jsonl", _conversations())
    _set(ws / "params.yaml", "distill", {"max_new_tokens": 4, "batch_size": 3, **distill})
    t = _stub_target(_conversations(), eos_from=1)
    return self_distill.run(load_params(), metrics_path=ws / "metrics/self_distill.json",
                            load_target=lambda *a, **k: t, load_tokenizer=lambda *a, **k: (t.tokenizer, None))


def test_extract_refuses_replies_written_by_another_target(ws):
    """The measured case: self-distill ran, then the target's chat template was replaced and
    identify-inputs rerun; extract run on its own (`dvc repro -s extract`) must not take the old
    replies and stamp them with the new target's identity."""
    _distill_in(ws)
    fp = provenance.read(ws / "data/distilled")
    assert fp["stage"] == "self-distill" and fp["target"]["files"]["chat_template.jinja"]
    assert set(fp["inputs"]) == {f"data/conversations/{s}.jsonl" for s in ("train", "val", "publish")}
    (ws / "target/chat_template.jinja").write_text("a new template\n")
    from stages import extract

    with pytest.raises(StaleError, match=r"^extract: data/distilled was built by self-distill for another target "
                                         r"\(chat_template.jinja changed\).*dvc repro self-distill"):
        extract.main()


def test_self_distill_refuses_conversations_of_other_params_or_another_source(ws):
    """prepare-data's output records its params and the data source's sha256; self-distill run on
    its own refuses it after either changed, naming prepare-data. A source file rewritten at the same
    size with its mtime set back is caught too (its content is hashed)."""
    from stages import prepare_data

    src = ws / "chats.jsonl"
    rows = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": f"answer {i}"}]} for i in range(12)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _set(ws / "params.yaml", "data", {"source": str(src), "val": 2, "test": 2, "publish": 2, "code_prompts": 0})
    prepare_data.prepare(load_params())
    fp = provenance.read(ws / "data/conversations")
    assert fp["stage"] == "prepare-data" and fp["target"] is None
    assert fp["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    from stages import self_distill

    p = load_params()
    p.distill.enabled = False  # copies: the check comes first either way
    self_distill.run(p, metrics_path=ws / "m.json")  # unchanged: accepted
    p.data.val = 3
    with pytest.raises(StaleError, match=r"^self-distill: data/conversations was built by prepare-data with "
                                         r"data.val = 2, params.yaml now has data.val = 3.*dvc repro prepare-data"):
        self_distill.run(p, metrics_path=ws / "m.json")
    st = src.stat()
    src.write_text(src.read_text().replace("answer 7", "answer 8"))  # same size
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert src.stat().st_size == st.st_size and src.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(StaleError, match=r"^self-distill: data/conversations was built by prepare-data from "
                                         r"another data source \(sha256 .*dvc repro prepare-data"):
        self_distill.run(load_params(), metrics_path=ws / "m.json")


def test_export_refuses_a_target_gguf_of_another_target(ws):
    """models/target_gguf records the target it was converted from (target-gguf); export-gguf run on
    its own after the target changed refuses it before converting anything."""
    d = ws / "models/target_gguf"
    d.mkdir(parents=True)
    (d / provenance.FILE).write_text(json.dumps(provenance.record("target-gguf", load_params(), [])))
    provenance.check(d, load_params(), reader="x")  # unchanged: accepted
    (ws / "target/tokenizer.json").write_text("another tokenizer\n")
    from stages import export_gguf

    with pytest.raises(StaleError, match=r"^export-gguf@scratch: models/target_gguf was built by target-gguf for "
                                         r"another target \(tokenizer.json changed\).*dvc repro target-gguf"):
        export_gguf.main("scratch")
    assert not (ws / "models/scratch.gguf").exists()


def test_a_big_file_rewritten_at_its_size_and_mtime_is_hashed_again(tmp_path, monkeypatch):
    """sha256_cached keeps a file's digest by path, size, mtime, ctime and inode: a same-size
    rewrite in place whose mtime is set back (same path, size, mtime and inode) gets its new digest.
    Negative control: the untouched file is served from the cache (its digest is not recomputed)."""
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "weights.bin"
    f.write_bytes(b"a" * (2 << 20))
    first = provenance.sha256_cached(f)
    assert first == hashlib.sha256(f.read_bytes()).hexdigest()
    calls = []
    real = provenance._sha256
    monkeypatch.setattr(provenance, "_sha256", lambda p: calls.append(p) or real(p))
    assert provenance.sha256_cached(f) == first and calls == []  # cached
    st = f.stat()
    time.sleep(0.05)  # past the filesystem's timestamp granularity
    with open(f, "r+b") as fh:  # in place: the same inode
        fh.seek(1 << 20)
        fh.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = f.stat()
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert provenance.sha256_cached(f) == hashlib.sha256(f.read_bytes()).hexdigest() != first


# ------------------------------------------------------------------------- params.yaml readings

def test_yes_is_a_string_for_eyas_as_for_dvc(tmp_path):
    (tmp_path / "params.yaml").write_text("train_finetune:\n  gate_override: yes\n")
    with pytest.raises(ParamsError, match=r"'train_finetune.gate_override' must be true or false, got 'yes' "
                                          r"\(as DVC reads YAML 1.2"):
        load_params(tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("train_finetune:\n  gate_override: true\n")
    assert load_params(tmp_path / "params.yaml").train_finetune.gate_override is True


STAGE = """stages:
  check:
    cmd: >-
      python -c "from eyas.params.full import load_params;
      print('override', load_params().train_finetune.gate_override)"
    params: [train_finetune, train]
"""


def _dvc_repo(tmp_path: Path) -> tuple[Path, dict]:
    repo = tmp_path / "r"
    repo.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))},
           "PYTHONPATH": str(REPO)}
    (repo / "dvc.yaml").write_text(STAGE)
    (repo / "params.yaml").write_text("train_finetune:\n  gate_override: false\ntrain:\n  epochs: 1\n")
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
    return repo, env


def _exp_run(repo: Path, env: dict, *sets: str) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("-S", s)]
    return subprocess.run([sys.executable, "-m", "dvc", "exp", "run", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_dvc_exp_run_set_readings(tmp_path):
    """With the real `dvc exp run -S`: `=yes` is refused by the stage (DVC records the string "yes"),
    `=true` is True for both; a stray `+key` DVC wrote into params.yaml is named with the fix."""
    repo, env = _dvc_repo(tmp_path)
    r = _exp_run(repo, env, "train_finetune.gate_override=yes")
    assert r.returncode != 0 and "as DVC reads YAML 1.2" in r.stdout + r.stderr
    subprocess.run(["git", "checkout", "--", "params.yaml"], cwd=repo, check=True)
    r = _exp_run(repo, env, "train_finetune.gate_override=true")
    assert r.returncode == 0 and "override True" in r.stdout + r.stderr, r.stderr[-2000:]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert lock["stages"]["check"]["params"]["params.yaml"]["train_finetune"]["gate_override"] is True
    subprocess.run(["git", "checkout", "--", "params.yaml"], cwd=repo, check=True)
    r = _exp_run(repo, env, "+train.epoch=2")  # the form DVC's own error suggests for a new key
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "'train.epoch' is not in the committed params.yaml (git HEAD)" in out
    assert "git checkout -- params.yaml" in out


@pytest.mark.slow
def test_a_failed_identify_inputs_keeps_its_committed_outputs(tmp_path):
    """With the real `dvc repro`: a stage declaring the outputs as dvc.yaml's identify-inputs declares
    them, whose command fails (as a bad params value fails it), leaves data/inputs/*.json (git-tracked)
    as they were. Negative control: the same outputs without ``persist`` are deleted by DVC before
    the stage runs, and the failed run loses them."""
    outs = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["identify-inputs"]["outs"]
    assert {next(iter(o)) for o in outs} == {"data/inputs/target.json", "data/inputs/source.json"}
    for declared, kept in ((outs, True), ([{k: {**v, "persist": False}} for o in outs for k, v in o.items()], False)):
        (tmp_path / str(kept)).mkdir()
        repo, env = _dvc_repo(tmp_path / str(kept))
        (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"identify-inputs": {
            "cmd": "python -c \"raise SystemExit('bad params')\"", "always_changed": True, "outs": declared}}}))
        (repo / "data" / "inputs").mkdir(parents=True)
        for o in outs:
            (repo / next(iter(o))).write_text('{"committed": true}\n')
        r = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode != 0 and "bad params" in r.stdout + r.stderr, r.stdout + r.stderr
        for o in outs:
            f = repo / next(iter(o))
            assert f.exists() is kept and (not kept or f.read_text() == '{"committed": true}\n'), f


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_local_target_weights_are_part_of_its_identity(tmp_path, monkeypatch, shard):
    """A local HF target whose weights are replaced under the same config.json gets another
    identity (so identify-inputs rewrites data/inputs/target.json and DVC reruns what it feeds),
    for a single model.safetensors and for shards named by the index. Negative control: the
    untouched directory, hashed again, has the same identity."""
    from types import SimpleNamespace

    monkeypatch.chdir(tmp_path)  # the hash cache (.eyas/) goes here
    d = tmp_path / "target"
    kw = {"max_shard_size": shard} if shard else {}
    tiny_target(seed=0).model.save_pretrained(d, **kw)
    config = (d / "config.json").read_bytes()
    tp = SimpleNamespace(path=str(d), gguf_file=None, revision=None)
    before = provenance.target_identity(tp)
    weights = sorted(p.name for p in d.iterdir() if p.suffix == ".safetensors")
    if shard:  # the index names every shard
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(weights) and len(weights) > 1
    else:
        assert weights == ["model.safetensors"]
    assert sorted(k for k in before["files"] if k.endswith(".safetensors")) == weights
    assert provenance.target_identity(tp) == before  # nothing touched: same identity
    other = tmp_path / "other"
    tiny_target(seed=1).model.save_pretrained(other, **kw)  # other weights, the same config
    assert (other / "config.json").read_bytes() == config
    changed = weights[-1]
    shutil.copyfile(other / changed, d / changed)
    after = provenance.target_identity(tp)
    assert after != before and after["files"]["config.json"] == before["files"]["config.json"]
    assert [k for k in before["files"] if before["files"][k] != after["files"][k]] == [changed]
    assert provenance._diff_target(before, after) == [f"{changed} changed"]


@pytest.mark.parametrize("stage", ["self_distill", "eval_accept_len"])
def test_a_reader_of_the_conversations_loads_the_sections_their_check_reads(stage, tmp_path):
    """Each stage loads only the params sections it names (eyas.params.schema.load_sections); the
    conversations' fingerprint records their data source, which the check reads from params ``data``.
    The sections are read from the stage's own ``load_sections(...)`` call, so a stage that drops
    ``data`` fails here, as it would fail at its check."""
    import ast
    import importlib

    from eyas.params.schema import load_sections

    tree = ast.parse((REPO / "stages" / f"{stage}.py").read_text())
    names = {a.asname or a.name: a.name for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and n.module == "eyas.params" for a in n.names}
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "load_sections"]
    sections = [importlib.import_module(f"eyas.params.{names[a.id]}") for a in call.args]
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"val": 2}}))
    fp = provenance.record("prepare-data", load_params(params), [], target=False, source=True)
    provenance.check(tmp_path, load_sections(*sections, path=params), reader=stage, fingerprint=fp)
    params.write_text(yaml.safe_dump({"data": {"val": 3}}))
    with pytest.raises(StaleError, match=r"data.val = 2, params.yaml now has data.val = 3"):
        provenance.check(tmp_path, load_sections(*sections, path=params), reader=stage, fingerprint=fp)
