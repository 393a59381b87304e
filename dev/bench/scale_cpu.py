"""Data-parallel correctness at 1, 2, 4 and 8 ranks on CPU (gloo), DDP and FSDP2.

    python3 dev/bench/scale_cpu.py            # -> dev/results/scale_correctness_cpu.json

Runs dev/bench/bench_ddp.py's phase 2 (``--device cpu --tiny --skip-scaling``) under
``torch.distributed.run`` with W = 1, 2, 4, 8 processes and ``--strategy ddp`` / ``fsdp``: the real
training path (``eyas.training.unroll.TTTUnroll`` wrapped by ``eyas.training.distributed.wrap_data_parallel``,
global-token loss normalisation, clip, AdamW, cosine schedule) on a tiny drafter (hidden 64,
vocab 1000, draft vocab 200, 7 TTT steps), the SAME global batch of 8 rows x 128 tokens per step
split over the W ranks (rank r takes rows r::W). W = 1 is one process, where the wrapper is a
no-op: the reference of both strategies. Recorded per (strategy, W): the first 10 global losses and
gradient norms, their max abs/rel difference from W = 1, and each rank's training state in bytes
counted from the tensors it holds (FSDP: its local shards, so the 1/W is visible), with the ratio
of its trainable state (weights + gradients + AdamW) to W = 1's.

A mismatch beyond fp32 reduction-order noise (``--rel-tol``, default 1e-5) exits non-zero after
writing the file. One thread per process: 8 processes on 2 cores take about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from dev.bench.common import write_result  # noqa: E402

WORLDS = (1, 2, 4, 8)
GLOBAL_ROWS = 8


def run_one(world: int, strategy: str, steps: int, lr: float, out: Path) -> tuple[dict, str, float]:
    """One bench_ddp.py phase-2 run under torchrun; (its result, the command, wall seconds).

    Raises:
        RuntimeError: the run failed (its stderr's tail in the message).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "dev/bench/bench_ddp.py", "--device", "cpu", "--tiny", "--skip-scaling", "--strategy", strategy,
           "--global-rows", str(GLOBAL_ROWS), "--equiv-steps", str(steps), "--lr", str(lr), "--out", str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"W={world} {strategy} failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    shown = " ".join(["python3"] + cmd[1:-1] + [f"TMPDIR/{out.name}"])  # a temporary file, read back here
    return json.loads(out.read_text()), shown, wall


def diffs(xs: list[float], ref: list[float]) -> dict:
    """Max absolute and relative difference of ``xs`` from ``ref`` (same length)."""
    if len(xs) != len(ref):
        raise ValueError(f"{len(xs)} values against {len(ref)} of W=1")
    ab = [abs(x - r) for x, r in zip(xs, ref)]
    return {"max_abs": max(ab), "max_rel": max(a / abs(r) for a, r in zip(ab, ref))}


def trainable(state: dict) -> float:
    return state["trainable_weights"] + state["grads"] + state["adamw_state"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-3, help="high enough that 10 steps move the weights")
    ap.add_argument("--rel-tol", type=float, default=1e-5)
    ap.add_argument("--out", default="scale_correctness_cpu.json")
    a = ap.parse_args()
    runs, commands, bad = {}, [], []
    with tempfile.TemporaryDirectory(prefix="eyas_scale_") as tmp:
        for strategy in ("ddp", "fsdp"):
            for w in WORLDS:
                if w == 1 and "w1" in runs:
                    continue
                doc, cmd, wall = run_one(w, strategy, a.steps, a.lr, Path(tmp) / f"{strategy}_w{w}.json")
                runs["w1" if w == 1 else f"{strategy}_w{w}"] = {**doc["equiv"], "wall_s": round(wall, 1)}
                commands.append(cmd)
                print(f"W={w} {strategy if w > 1 else '(one process)'}: {wall:.1f} s, "
                      f"losses {doc['equiv']['losses'][:3]}...", flush=True)
    ref = runs["w1"]
    ref_state = trainable(ref["state_bytes_per_rank"][0])
    table = {}
    for key, r in runs.items():
        row = {"losses": r["losses"], "grad_norms": r["grad_norms"], "rows_per_rank": r["rows_per_rank"],
               "wall_s": r["wall_s"], "state_bytes_per_rank": r["state_bytes_per_rank"],
               "trainable_state_over_w1_per_rank": [trainable(s) / ref_state for s in r["state_bytes_per_rank"]]}
        if key != "w1":
            row["loss_vs_w1"] = diffs(r["losses"], ref["losses"])
            row["grad_norm_vs_w1"] = diffs(r["grad_norms"], ref["grad_norms"])
            if max(row["loss_vs_w1"]["max_rel"], row["grad_norm_vs_w1"]["max_rel"]) > a.rel_tol:
                bad.append(key)
        table[key] = row
    moved = diffs(ref["losses"][-1:], ref["losses"][:1])["max_rel"]
    doc = {"what": "data-parallel correctness on CPU (gloo): eyas' TTT training step of a tiny drafter under "
                   "DDP and FSDP2 at W = 1, 2, 4, 8 processes, the same global batch split over the ranks",
           "kind": "CPU, gloo, 1 thread per process",
           "drafter": "hidden 64, intermediate 160, 4/2 heads x 16, vocab 1000, draft vocab 200, lm_head trainable",
           "ttt_steps": 7, "global_rows": GLOBAL_ROWS, "global_tokens": ref["global_tokens"], "lr": a.lr,
           "commands": commands, "rel_tol": a.rel_tol, "loss_moved_rel_over_run_w1": moved,
           "mismatches": bad, "runs": table}
    write_result(a.out, doc)
    for key, row in table.items():
        if key != "w1":
            print(f"{key}: loss max rel {row['loss_vs_w1']['max_rel']:.2e}, grad-norm max rel "
                  f"{row['grad_norm_vs_w1']['max_rel']:.2e}, trainable state per rank "
                  f"{row['trainable_state_over_w1_per_rank'][0]:.3f} of W=1", flush=True)
    if bad:
        raise SystemExit(f"losses or gradient norms differ from W=1 beyond {a.rel_tol}: {bad}")


if __name__ == "__main__":
    main()
