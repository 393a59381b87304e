"""The real pipeline (`dvc repro`) on the embedded default target and a few real conversations.

Slow (a few minutes: the GGUF target loads three times). It runs the real DVC and MLflow in a
temporary git repository holding a copy of this one's pipeline with tiny params.
"""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    # chat only: the stand-in (10 human chat conversations) must pass the fine-tune gate on val
    # (code conversations are tested in tests/test_code_data.py)
    "data": {"max_conversations": 40, "val": 4, "test": 3, "publish": 10, "code_prompts": 0},
    "distill": {"max_new_tokens": 8, "batch_size": 8, "splits": ["train", "val"], "max_prompt_tokens": 0},
    "extract": {"max_length": 128, "batch_size": 4, "shard_samples": 8},
    "vocab": {"draft_vocab_size": 512},
    # 3 epochs: on its 357 assistant tokens (as published drafters, it learns from nothing else) one
    # epoch left the remapped drafter near chance (step-0 val loss 5.80; ln(512) = 6.24)
    "stand_in": {"draft_vocab_size": 384, "epochs": 3},
    "remap": {"min_shared_fraction": 0.1},
    # a stand-in trained on 10 conversations is barely above chance: no accuracy floor (the gate's
    # chance bar, 10 / 512, stays)
    "train_finetune": {"gate_min_acc": 0.0},
    "train": {"epochs": 1, "batch_tokens": 512, "eval_every": 1000},
    "eval": {"chat_prompts": 2, "humaneval_prompts": 1, "max_new_tokens": 12, "num_draft_tokens": 3,
             "served_prompts": 1, "served_max_new_tokens": 8, "temperatures": [0.0, 1.0], "seeds": [0],
             "tree_topk": 2, "tree_num_steps": 3, "tree_num_draft_tokens": 5},
}


def run(cmd, cwd, env):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


@pytest.mark.slow
def test_dvc_repro_end_to_end(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("eyas", "stages"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "scripts").mkdir()
    for name in ("dvc.yaml", "scripts/build_llama_server.sh"):  # the build script pins llama.cpp's converter
        shutil.copy(ROOT / name, repo / name)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, values in TINY.items():
        params[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))}
    env["PYTHONPATH"] = str(repo)
    run(["git", "init", "-q"], repo, env)
    run([sys.executable, "-m", "dvc", "init", "-q"], repo, env)

    out = run([sys.executable, "-m", "dvc", "repro"], repo, env)
    for stage in ("identify-inputs", "prepare-data", "self-distill", "extract", "build-vocab", "stand-in-drafter",
                  "remap", "train-scratch", "train-finetune", "target-gguf", "export-gguf@scratch",
                  "export-gguf@finetune", "eval-accept-len@scratch", "eval-accept-len@finetune"):
        assert f"Running stage '{stage}'" in out

    m = {p.stem: json.loads(p.read_text()) for p in (repo / "metrics").glob("*.json")}
    assert m["prepare_data"]["conversations"] == {"train": 23, "val": 4, "test": 3, "publish": 10}
    assert m["self_distill"]["splits"]["train"]["kept"] > 0
    assert m["extract"]["bytes_per_token"] == (3 + 1) * 576 * 2 + 9  # 3 aux + final, bf16
    # the size estimate made before the target loaded (rendered token counts) is exact
    assert m["extract"]["estimated_bytes"] == m["extract"]["bytes"] > m["extract"]["total_tokens"] * 4617
    assert 0.5 < m["vocab"]["coverage"] <= 1.0 and m["vocab"]["draft_vocab_size"] == 512
    assert m["remap"]["rows_carried"] + m["remap"]["rows_initialised"] == 512
    assert m["remap"]["shared_tokens"] == m["remap"]["rows_carried"]
    for name in ("scratch", "finetune"):
        ev = m[f"eval_{name}"]
        for bench in ("chat", "humaneval"):
            assert ev[bench]["lossless"] is True  # speculative greedy == plain greedy
            assert 1.0 <= ev[bench]["accept_len"] <= 4.0
            assert ev[bench]["settings"]["num_draft_tokens"] == 3
            verdict = ev[bench]["serving_verdict"]  # against this benchmark's own n-gram floor
            assert verdict["beats_ngram_floor"] == (ev[bench]["accept_len"] > ev["ngram"][bench]["accept_len"])
            assert set(verdict["sampled"]) == {"T1"}  # the served table's one temperature > 0
            rows = ev["served"][bench]["rows"]  # the served table (eyas/eval/served.py)
            assert set(rows) == {"eagle/chain/T0", "ngram/chain/T0", "eagle/chain/T1", "ngram/chain/T1",
                                 "eagle/tree/T0"}
            assert rows["eagle/tree/T0"]["matches_greedy"] is True
            engine = ev[bench]["engine"]  # llama.cpp serving this drafter (eyas/eval/llamacpp.py)
            assert engine["same_precision"]["lossless"] is True
            assert engine["agreement"]["ok"] is not False
    cfg = json.loads((repo / "models/scratch/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 512
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # default layers write no ids

    # every artifact later stages read carries its fingerprint (eyas/pipeline/provenance.py)
    assert json.loads((repo / "data/features/train/manifest.json").read_text())["fingerprint"]["stage"] == "extract"
    assert json.loads((repo / "models/vocab/vocab.json").read_text())["fingerprint"]["stage"] == "build-vocab"
    for d in ("stand_in", "remapped", "scratch", "finetune"):
        assert (repo / "models" / d / "fingerprint.json").is_file(), d

    # a second repro runs only identify-inputs (always_changed, seconds): its outputs are unchanged,
    # so nothing downstream reruns
    again = run([sys.executable, "-m", "dvc", "repro"], repo, env)
    assert [l for l in again.splitlines() if "Running stage" in l] == ["Running stage 'identify-inputs':"]

    # the stages logged child runs under one parent in <repo>/mlflow.db
    with sqlite3.connect(repo / "mlflow.db") as db:
        names = sorted(r[0] for r in db.execute("select name from runs"))
    # one parent + one child per stage
    assert len(names) == 14 and any(n.startswith("workspace") for n in names)
    assert "prepare-data" in names
