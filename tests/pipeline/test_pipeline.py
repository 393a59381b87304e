"""The real pipelines (`dvc repro`, then `dvc repro finetune/dvc.yaml`) on the embedded default target
and a few real conversations.

Slow (minutes: the GGUF target loads in several stages). It runs the real DVC and MLflow in a
temporary git repository holding a copy of this one's pipeline files with tiny params:

- `dvc repro` runs the default DAG (the scratch drafter) and no stage of the fine-tune comparison
  (published/dvc.yaml, finetune/dvc.yaml): `dvc status` lists them all as never run;
- with `remap.source` a real drafter directory (the scratch drafter copied, as `hf download` would
  leave a published one), `dvc repro finetune/dvc.yaml` remaps, fine-tunes, exports and evaluates
  it without training the stand-in;
- negative control: with `remap.source: models/stand_in`, remap pulls in `stand-in-drafter`.

Fast: benchmarks/bench_pipeline_cpu.py (the pipeline timed from a fresh clone) refuses bad arguments
before it deletes its last clone.
"""

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyas.pipeline.dvcfiles import PIPELINES

ROOT = Path(__file__).resolve().parents[2]

TINY = {
    # chat only (code conversations are tested in tests/data/test_code_data.py)
    "data": {"max_conversations": 40, "val": 4, "test": 3, "publish": 10, "code_prompts": 0},
    "distill": {"max_new_tokens": 8, "batch_size": 8, "splits": ["train", "val"], "max_prompt_tokens": 0},
    "extract": {"max_length": 128, "batch_size": 4, "shard_samples": 8},
    "vocab": {"draft_vocab_size": 512},
    # the stand-in (negative control) is only remapped: one epoch on its 10 conversations
    "stand_in": {"draft_vocab_size": 384, "epochs": 1},
    "remap": {"min_shared_fraction": 0.1},
    # the published drafter fine-tuned here is the scratch drafter of one epoch on 23 conversations: no
    # accuracy floor (the gate's chance bar, 2 / 512, stays)
    "train_finetune": {"gate_min_acc": 0.0},
    "train": {"epochs": 1, "batch_tokens": 512, "eval_every": 1000},
    "eval": {"chat_prompts": 2, "humaneval_prompts": 1, "max_new_tokens": 12, "num_draft_tokens": 3,
             "served_prompts": 1, "served_max_new_tokens": 8, "temperatures": [0.0, 1.0], "seeds": [0],
             "tree_topk": 2, "tree_num_steps": 3, "tree_num_draft_tokens": 5},
}
DEFAULT_DAG = {"identify-inputs", "synthesize-prompts", "prepare-data", "self-distill", "extract", "build-vocab",
               "train-scratch", "target-gguf", "export-gguf@scratch", "eval-accept-len@scratch"}
COMPARISON = {"stand-in-drafter", "remap", "train-finetune", "export-gguf@finetune", "eval-accept-len@finetune"}


def run(cmd, cwd, env):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def ran_stages(out: str) -> set[str]:
    """Stage names from DVC's "Running stage 'x':" lines (``finetune/dvc.yaml:remap`` -> ``remap``)."""
    return {m.rpartition(":")[2] for m in re.findall(r"Running stage '([^']+)'", out)}


def out_of_date(repo: Path, env: dict) -> set[str]:
    """Stage names `dvc status` lists (every pipeline file's), identify-inputs (always changed) left out."""
    r = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    st = json.loads(r.stdout)
    return {name.rpartition(":")[2] for name in st} - {"identify-inputs"}


def set_params(repo: Path, **sections) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in sections.items():
        params[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def check_eval(ev: dict) -> None:
    """metrics/eval_<drafter>.json of a tiny run: lossless, in range, the decoding-modes table and llama.cpp's block."""
    for bench in ("chat", "humaneval"):
        assert ev[bench]["lossless"] is True  # speculative greedy == plain greedy
        assert 1.0 <= ev[bench]["accept_len"] <= 4.0
        assert ev[bench]["settings"]["num_draft_tokens"] == 3
        verdict = ev[bench]["serving_verdict"]  # against this benchmark's own n-gram floor
        assert verdict["beats_ngram_floor"] == (ev[bench]["accept_len"] > ev["ngram"][bench]["accept_len"])
        assert set(verdict["sampled"]) == {"T1"}  # the decoding-modes table's one temperature > 0
        rows = ev["served"][bench]["rows"]  # the decoding-modes table (eyas/eval/modes.py)
        assert set(rows) == {"eagle/chain/T0", "ngram/chain/T0", "eagle/chain/T1", "ngram/chain/T1", "eagle/tree/T0"}
        assert rows["eagle/tree/T0"]["matches_greedy"] is True
        engine = ev[bench]["engine"]  # llama.cpp serving this drafter (eyas/eval/llamacpp.py)
        assert engine["same_precision"]["lossless"] is True
        assert engine["agreement"]["ok"] is not False


@pytest.mark.slow
def test_dvc_repro_end_to_end(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("eyas", "stages"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in (*PIPELINES, "scripts/build_llama_server.sh"):  # the build script pins llama.cpp's converter
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    shutil.copy(ROOT / "params.yaml", repo / "params.yaml")
    set_params(repo, **TINY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["PYTHONPATH"] = str(repo)
    run(["git", "init", "-q"], repo, env)
    run([sys.executable, "-m", "dvc", "init", "-q"], repo, env)
    dvc = [sys.executable, "-m", "dvc"]

    # 1. the default DAG, and nothing of the fine-tune comparison
    out = run([*dvc, "repro"], repo, env)
    assert ran_stages(out) == DEFAULT_DAG, out[-3000:]
    assert out_of_date(repo, env) == COMPARISON  # never run: every stage of published/ and finetune/
    for d in ("stand_in", "remapped", "finetune", "finetune.gguf"):
        assert not (repo / "models" / d).exists(), d
    assert not (repo / "published/dvc.lock").exists() and not (repo / "finetune/dvc.lock").exists()
    assert set(yaml.safe_load((repo / "dvc.lock").read_text())["stages"]) == DEFAULT_DAG

    m = {p.stem: json.loads(p.read_text()) for p in (repo / "metrics").glob("*.json")}
    assert set(m) == {"synthesize_prompts", "prepare_data", "self_distill", "extract", "vocab", "train_scratch",
                      "eval_scratch"}
    assert m["synthesize_prompts"] == {"prompts": 0} and (repo / "data/synth/conversations.jsonl").read_bytes() == b""
    assert "synth" not in m["prepare_data"]  # off: prepare-data's outputs as before
    assert m["prepare_data"]["conversations"] == {"train": 23, "val": 4, "test": 3, "publish": 10}
    assert m["self_distill"]["splits"]["train"]["kept"] > 0
    assert m["extract"]["bytes_per_token"] == (3 + 1) * 576 * 2 + 9  # 3 aux + final, bf16
    # the size estimate made before the target loaded (rendered token counts) is exact
    assert m["extract"]["estimated_bytes"] == m["extract"]["bytes"] > m["extract"]["total_tokens"] * 4617
    assert 0.5 < m["vocab"]["coverage"] <= 1.0 and m["vocab"]["draft_vocab_size"] == 512
    check_eval(m["eval_scratch"])
    cfg = json.loads((repo / "models/scratch/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 512
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # default layers write no ids

    # every artifact later stages read carries its fingerprint (eyas/pipeline/provenance.py)
    assert json.loads((repo / "data/features/train/manifest.json").read_text())["fingerprint"]["stage"] == "extract"
    assert json.loads((repo / "models/vocab/vocab.json").read_text())["fingerprint"]["stage"] == "build-vocab"
    assert (repo / "models/scratch/fingerprint.json").is_file()

    # llama.cpp serves the drafter again from its eval's record (benchmarks/engine_check.py, as the GPU
    # profile does after an eval without the engine): the stage's engine figures, count for count
    (repo / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks/engine_check.py", repo / "benchmarks")
    run([sys.executable, "benchmarks/engine_check.py", "scratch", "--out", "engine.json"], repo, env)
    served = json.loads((repo / "engine.json").read_text())
    counts = ("accepted", "drafted", "verify_steps", "output_sha256")
    for bench in ("chat", "humaneval"):
        stage = m["eval_scratch"][bench]["engine"]
        assert served["eyas_eval"][bench]["accept_len"] == m["eval_scratch"][bench]["accept_len"]
        assert served[bench]["agreement"] == stage["agreement"]
        for t in ("same_precision", "quantized"):
            assert [[x[c] for c in counts] for x in served[bench][t]["per_prompt"]] == \
                   [[x[c] for c in counts] for x in stage[t]["per_prompt"]], (bench, t)
    # one benchmark alone (a cut-off run's missing half): the same counts, the other benchmark not served
    run([sys.executable, "benchmarks/engine_check.py", "scratch", "--benchmarks", "humaneval", "--out", "he.json"],
        repo, env)
    alone = json.loads((repo / "he.json").read_text())
    assert set(alone["eyas_eval"]) == {"humaneval"} and "chat" not in alone
    assert [[x[c] for c in counts] for x in alone["humaneval"]["same_precision"]["per_prompt"]] == \
           [[x[c] for c in counts] for x in served["humaneval"]["same_precision"]["per_prompt"]]
    # negative control: eyas' record moved by 5 verify steps a prompt is a disagreement: exit 1, file written
    assert m["eval_scratch"]["chat"]["engine"]["agreement"]["compared"] > 0  # else there is nothing to move
    record = (repo / "metrics/eval_scratch.json").read_bytes()
    ev = json.loads(record)
    for x in ev["chat"]["per_prompt"]:
        x["verify_steps"] += 5
    (repo / "metrics/eval_scratch.json").write_text(json.dumps(ev))
    (repo / "engine.json").unlink()
    r = subprocess.run([sys.executable, "benchmarks/engine_check.py", "scratch", "--out", "engine.json"], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 1 and "disagree" in (r.stdout + r.stderr).lower(), r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads((repo / "engine.json").read_text())["chat"]["agreement"]["ok"] is False
    # a later benchmark's broken record is refused (with nothing written), and the eval record is no --out
    ev = json.loads(record)
    del ev["humaneval"]["per_prompt"]
    (repo / "metrics/eval_scratch.json").write_text(json.dumps(ev))
    (repo / "engine.json").unlink()
    for out, msg in (("engine.json", "humaneval has no per_prompt walks"),
                     ("metrics/eval_scratch.json", "--out metrics/eval_scratch.json: must be a new or result file")):
        r = subprocess.run([sys.executable, "benchmarks/engine_check.py", "scratch", "--out", out], cwd=repo,
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 1 and msg in r.stderr, r.stderr[-2000:]
    assert not (repo / "engine.json").exists()
    (repo / "metrics/eval_scratch.json").write_bytes(record)  # as the stage wrote it

    # a second repro runs only identify-inputs (always_changed, seconds): its outputs are unchanged,
    # so nothing downstream reruns
    again = run([*dvc, "repro"], repo, env)
    assert [l for l in again.splitlines() if "Running stage" in l] == ["Running stage 'identify-inputs':"]

    # the stages logged child runs under one parent in <repo>/mlflow.db
    with sqlite3.connect(repo / "mlflow.db") as db:
        names = sorted(r[0] for r in db.execute("select name from runs"))
    # one parent + one child per stage but identify-inputs (it logs no run)
    assert len(names) == len(DEFAULT_DAG) and any(n.startswith("workspace") for n in names)
    assert "prepare-data" in names

    # 2. the comparison with a real drafter directory: the scratch drafter as `hf download` would leave
    # a published one (config.json + model.safetensors, no fingerprint); the stand-in is never trained
    shutil.copytree(repo / "models/scratch", repo / "models/published",
                    ignore=shutil.ignore_patterns("fingerprint.json"))
    set_params(repo, remap={"source": "models/published"})
    out = run([*dvc, "repro", "finetune/dvc.yaml"], repo, env)
    assert ran_stages(out) == {"identify-inputs", "remap", "train-finetune", "export-gguf@finetune",
                               "eval-accept-len@finetune"}, out[-3000:]
    assert not (repo / "models/stand_in").exists() and not (repo / "published/dvc.lock").exists()
    assert out_of_date(repo, env) == {"stand-in-drafter"}  # still never run, and nothing waits on it
    lock = yaml.safe_load((repo / "finetune/dvc.lock").read_text())["stages"]
    assert "models/published" in [d["path"] for d in lock["remap"]["deps"]]  # DVC hashes the source
    m = {p.stem: json.loads(p.read_text()) for p in (repo / "metrics").glob("*.json")}
    assert m["remap"]["source"] == "models/published"
    assert m["remap"]["shared_tokens"] == m["remap"]["rows_carried"] == 512  # the same vocab: every row carried
    assert m["train_finetune"]["steps"] > 0
    check_eval(m["eval_finetune"])
    for d, stage in (("remapped", "remap"), ("finetune", "train-finetune")):
        assert json.loads((repo / "models" / d / "fingerprint.json").read_text())["stage"] == stage
    # an edit inside the source directory reruns remap (a new drafter downloaded there)
    (repo / "models/published/config.json").write_text((repo / "models/published/config.json").read_text() + "\n")
    assert "remap" in out_of_date(repo, env)

    # 3. negative control: remap.source models/stand_in pulls in published/dvc.yaml's stand-in
    set_params(repo, remap={"source": "models/stand_in"})
    out = run([*dvc, "repro", "finetune/dvc.yaml:remap"], repo, env)
    assert ran_stages(out) == {"identify-inputs", "stand-in-drafter", "remap"}, out[-3000:]
    assert (repo / "published/dvc.lock").is_file() and (repo / "models/stand_in/fingerprint.json").is_file()
    m = json.loads((repo / "metrics/remap.json").read_text())
    assert m["source"] == "models/stand_in" and m["rows_carried"] + m["rows_initialised"] == 512
    assert m["shared_tokens"] == m["rows_carried"] < 512  # the stand-in's own vocab: rows to move
    assert out_of_date(repo, env) == {"train-finetune"}  # its input changed: `dvc repro finetune/dvc.yaml` goes on


# --- benchmarks/bench_pipeline_cpu.py, the pipeline timed from a fresh clone: its arguments -----------

@pytest.mark.parametrize("args, message", [
    (["--preset", "{d}/missing.yaml"], "--preset {d}/missing.yaml: {d}/missing.yaml: no such preset"),
    (["--preset", "{d}/empty.yaml"], "--preset {d}/empty.yaml: {d}/empty.yaml: a preset sets at least one key, got "
                                     "only empty sections"),
    (["--growth-shard-samples", "0"], "--growth-shard-samples must be >= 1, got 0"),
])
def test_pipeline_bench_refuses_bad_arguments_before_deleting_its_last_clone(tmp_path, args, message):
    """The benchmark deletes its previous clone (``--workdir``) before cloning again: an argument it
    would refuse after the ~40-minute pipeline, or a preset the clone's params would refuse, stops it
    first, the old clone untouched (before these checks, the clone was gone when the preset failed)."""
    work = tmp_path / "w"
    work.mkdir()
    (work / ".bench_clone").write_text("")
    (work / "kept.txt").write_text("a finished run")
    (tmp_path / "empty.yaml").write_text("train: {}\n")
    args = [a.format(d=tmp_path) for a in args]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_pipeline_cpu.py"), "--workdir", str(work),
                        "--out", str(tmp_path / "o.json"), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (1, message.format(d=tmp_path))
    assert (work / "kept.txt").read_text() == "a finished run" and not (tmp_path / "o.json").exists()
