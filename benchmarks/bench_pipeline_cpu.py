"""Wall time and peak memory of every stage of `dvc repro` (the default DAG) on the embedded default,
from a fresh clone; then extract's peak memory at two data sizes (does it stream?).

    python benchmarks/bench_pipeline_cpu.py                      # -> pipeline_cpu.json
    python benchmarks/bench_pipeline_cpu.py --skip-pipeline      # only the extract-growth part
    python benchmarks/bench_pipeline_cpu.py --preset presets/quick.yaml --growth-n 0 \
        --out pipeline_cpu_quick.json                      # the quick trial, no growth part

Pipeline part: ``git clone`` of this repository's HEAD into ``--workdir`` (no outputs, no DVC
cache: every stage runs, as on a fresh machine), then ``dvc repro --single-item STAGE`` for each
stage in the order ``dvc repro --dry`` prints (the default DAG, root ``dvc.yaml``; with ``--preset``
the preset merged into the clone's ``params.yaml`` first, as ``eyas.pipeline.preset --write`` does),
then a second plain ``dvc repro`` (must do nothing) and ``dvc status dvc.yaml``; ``--resume`` pulls a
newer commit into the clone and reruns only the stages it
made stale (the total then sums figures of two sessions on the same idle machine). Per stage it
records:

- ``seconds``: wall time of the ``dvc repro -s`` call (DVC's own hashing included);
- ``peak_rss_largest_process_mib``: the kernel's ``ru_maxrss`` from ``wait4`` (MiB): the peak
  resident set of the largest single process in the stage's tree (dvc, its shell, the stage);
- ``peak_rss_tree_mib``: the peak of the summed RSS of the whole process tree, dvc included,
  sampled every 0.2 s (a sampled figure: spikes shorter than that can be missed).

Extract-growth part: in the same clone, ``python -m stages.extract`` twice, on the first N and the
first 4N self-distilled train conversations (val and publish cut to 4 each), with
``extract.shard_samples`` small enough that both runs write several shards. The whole-run peak is
the target's load (GGUF dequantisation), so the figure compared is the steady-state peak sampled
once the train progress bar appears. If extract streams, the two are equal up to the O(tokens)
token-id lists it keeps (~100 bytes/token in Python); if it kept features, the larger run would
add ``feature_mib_of_extra_tokens``.

The file also records the time goal (``goal_minutes``: 40 for the default, 10 for a ``--preset``,
and ``within_goal``) and, from ``metrics/eval_scratch.json``, the acceptance
lengths it reached beside the n-gram floor and the engine's (llama.cpp) figures, so a faster
configuration cannot hide a worse drafter.

Run it on an otherwise idle machine: CPU contention inflates the times (not the memory).
Raises SystemExit when a stage fails (its stderr tail is printed) or the second repro runs any stage but
``identify-inputs`` (always changed: it re-hashes the target's files and rewrites nothing unchanged).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from eyas import yaml12
from eyas.params.full import ParamsError
from eyas.pipeline import preset

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
STAGES_FILE = ".bench_stages.json"  # per-stage figures, written as each stage finishes
ALWAYS_CHANGED = {"identify-inputs"}  # dvc.yaml's always_changed stage: it reruns, and rewrites nothing unchanged
CLONE_MARK = ".bench_clone"  # marks a --workdir this script cloned (only such a dir is ever deleted)


def run_measured(cmd: list[str], cwd: Path, marker: bytes | None = None) -> dict:
    """Run ``cmd``; return wall seconds, return code, kernel and sampled peak RSS (MiB), output tail.

    With ``marker``, also ``peak_rss_after_marker_mib``: the sampled tree peak from the moment
    ``marker`` first appears in the command's output (e.g. a progress bar's label, printed once
    the model is loaded), which leaves a load-time spike out of the steady-state figure.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, seen = bytearray(), threading.Event()

    def read() -> None:
        while chunk := proc.stdout.read1(65536):
            out.extend(chunk)
            if marker and not seen.is_set() and marker in out:
                seen.set()
            del out[:-16384]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    root, peak_tree, peak_marked = psutil.Process(proc.pid), 0, 0
    while True:  # reaped with wait4 (not Popen.poll) to get the kernel's rusage of the tree
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        rss = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        peak_tree = max(peak_tree, rss)
        if seen.is_set():
            peak_marked = max(peak_marked, rss)
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=10)
    r = {"seconds": round(time.perf_counter() - t0, 1), "returncode": proc.returncode,
         "peak_rss_largest_process_mib": round(usage.ru_maxrss * 1024 / MIB, 1),  # Linux: KiB
         "peak_rss_tree_mib": round(peak_tree / MIB, 1)}
    if marker:
        r["peak_rss_after_marker_mib"] = round(peak_marked / MIB, 1)
    r["output_tail"] = out.decode(errors="replace")[-3000:]
    return r


def stage_order(cwd: Path, force: bool = True) -> list[str]:
    """Stages in the order `dvc repro` runs them (all with ``force``, else only those out of date)."""
    out = subprocess.run(["dvc", "repro", "--dry", *(["--force"] if force else [])], cwd=cwd,
                         capture_output=True, text=True, check=True).stdout
    return [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage '")]


def check(r: dict, what: str) -> None:
    if r["returncode"] != 0:
        sys.stderr.write(r["output_tail"])
        raise SystemExit(f"{what} failed (exit {r['returncode']})")


def pipeline(work: Path, resume: bool = False) -> dict:
    """Every stage, measured; with ``resume`` only the stages a newer commit made stale (after a
    ``git pull`` in ``work``), keeping the figures already recorded for the others.

    Each stage's figures are saved to ``work/STAGES_FILE`` as soon as it finishes."""
    done_file = work / STAGES_FILE
    stages = json.loads(done_file.read_text()) if resume and done_file.exists() else {}
    if resume:
        subprocess.run(["git", "pull", "--quiet", str(REPO), "HEAD"], cwd=work, check=True)
    for stage in stage_order(work, force=not resume):
        r = run_measured(["dvc", "repro", "--single-item", stage], work)
        check(r, f"dvc repro -s {stage}")
        stages[stage] = {k: v for k, v in r.items() if k != "output_tail"}
        done_file.write_text(json.dumps(stages, indent=1))
        print(f"{stage}: {stages[stage]}", flush=True)
    total = sum(st["seconds"] for st in stages.values())
    again = run_measured(["dvc", "repro"], work)
    check(again, "second dvc repro")
    # the default DAG's stages: the fine-tune comparison (finetune/dvc.yaml) is not part of `dvc repro`
    status = subprocess.run(["dvc", "status", "dvc.yaml"], cwd=work, capture_output=True, text=True).stdout.strip()
    rerun = set(re.findall(r"^Running stage '([^']+)'", again["output_tail"], re.M)) - ALWAYS_CHANGED
    stale = {line.rstrip(":") for line in status.splitlines() if line and not line[0].isspace()} - ALWAYS_CHANGED
    if rerun or (stale and "Data and pipelines are up to date" not in status):
        raise SystemExit(f"second dvc repro was not a no-op (reran {sorted(rerun)}, stale {sorted(stale)}):\n"
                         f"{again['output_tail']}\n{status}")
    extract = json.loads((work / "metrics" / "extract.json").read_text())
    return {"stages": stages, "total_seconds": round(total, 1), "total_minutes": round(total / 60, 1),
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=work, capture_output=True,
                                     text=True).stdout.strip(),
            "second_repro_seconds": again["seconds"], "dvc_status": status,
            "max_stage_peak_rss_tree_mib": max(s["peak_rss_tree_mib"] for s in stages.values()),
            "extract_tokens": extract["total_tokens"], "bytes_per_token": extract["bytes_per_token"],
            "acceptance": acceptance(work)}


def acceptance(work: Path) -> dict:
    """Per benchmark of ``work/metrics/eval_scratch.json``: eyas' acceptance length, the n-gram
    floor's, and llama.cpp's with the same-precision and the quantized target (when served): its
    acceptance, its wall-clock speedup (tokens/s with the drafter over without), and the per-prompt
    agreement with eyas' loop (prompts compared, exactly equal, outside the tolerance)."""
    ev = json.loads((work / "metrics" / "eval_scratch.json").read_text())
    out = {}
    for bench in ("chat", "humaneval"):
        b, eng = ev[bench], ev[bench].get("engine") or {}
        served = [kind for kind in ("same_precision", "quantized") if kind in eng]
        agreement = eng.get("agreement") or {}
        out[bench] = {"eyas": b["accept_len"], "ngram": ev["ngram"][bench]["accept_len"], "lossless": b["lossless"],
                      "above_ngram": b["accept_len"] >= ev["ngram"][bench]["accept_len"],
                      **{f"llamacpp_{kind}": eng[kind]["accept_len"] for kind in served},
                      **{f"llamacpp_speedup_{kind}": eng[kind].get("speedup") for kind in served},
                      "llamacpp_agreement_ok": agreement.get("ok"),
                      "llamacpp_agreement": {k: len(agreement[k]) if k == "outside_tolerance" else agreement[k]
                                             for k in ("compared", "exact", "outside_tolerance") if k in agreement}}
    return out


def _cut_jsonl(src: Path, dst: Path, n: int) -> int:
    lines = [line for line in src.read_text().splitlines() if line.strip()][:n]
    dst.write_text("\n".join(lines) + "\n")
    return len(lines)


def extract_growth(work: Path, n: int, shard_samples: int) -> dict:
    """Peak RSS of `python -m stages.extract` on n and 4n train conversations, in a fresh clone
    beside ``work`` that takes ``work``'s self-distilled data (``work`` itself stays untouched)."""
    grow = work.with_name(work.name + "-growth")
    if grow.exists():
        if not (grow / CLONE_MARK).exists():
            raise SystemExit(f"{grow} exists and is not a clone this benchmark made: move it away")
        shutil.rmtree(grow)
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(grow)], check=True)
    (grow / CLONE_MARK).write_text("made by benchmarks/bench_pipeline_cpu.py; deleted by its next run\n")
    source = work / "data" / "distilled"
    (grow / "data" / "distilled").mkdir(parents=True)
    work = grow
    params = yaml12.load_file(work / "params.yaml")  # as DVC reads it, and written back so it reads the same
    params["extract"]["shard_samples"] = shard_samples
    (work / "params.yaml").write_text(yaml12.dump(params))
    runs = []
    for size in (n, 4 * n):
        counts = {split: _cut_jsonl(source / f"{split}.jsonl", work / "data" / "distilled" / f"{split}.jsonl",
                                    size if split == "train" else 4)
                  for split in ("train", "val", "publish")}
        if counts["train"] < size:
            raise SystemExit(f"only {counts['train']} train conversations for size {size}: lower --growth-n")
        r = run_measured([sys.executable, "-m", "stages.extract"], work, marker=b"extract train")
        check(r, f"extract on {size} conversations")
        m = json.loads((work / "metrics" / "extract.json").read_text())
        shards = len(list((work / "data" / "features" / "train").glob("*.safetensors")))
        runs.append({"train_conversations": size, "train_tokens": m["splits"]["train"]["tokens"],
                     "train_shards": shards, **{k: v for k, v in r.items() if k != "output_tail"}})
        print(f"extract growth: {runs[-1]}", flush=True)
    small, large = runs
    return {"shard_samples": shard_samples, "runs": runs,
            "steady_peak_growth_mib": round(large["peak_rss_after_marker_mib"] - small["peak_rss_after_marker_mib"], 1),
            "feature_mib_of_extra_tokens": round((large["train_tokens"] - small["train_tokens"])
                                                 * json.loads((work / "metrics" / "extract.json").read_text())["bytes_per_token"] / MIB, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/eyas-pipeline-bench"))
    ap.add_argument("--out", type=Path, default=Path("pipeline_cpu.json"))
    ap.add_argument("--skip-pipeline", action="store_true", help="reuse --workdir's finished pipeline run")
    ap.add_argument("--resume", action="store_true",
                    help="git pull this repo's HEAD into --workdir and rerun only the stages it made stale")
    ap.add_argument("--preset", type=Path, help="a presets/*.yaml merged into the clone's params.yaml before the "
                    "run (with --resume: the preset the clone was made with, recorded)")
    ap.add_argument("--growth-n", type=int, default=50,
                    help="train conversations of the small extract run (x4 for the large); 0 = no growth part")
    ap.add_argument("--growth-shard-samples", type=int, default=20)
    a = ap.parse_args()
    doc = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
           "machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                       "processor": platform.processor() or platform.machine(), "python": platform.python_version()},
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if a.growth_n < 0:
        raise SystemExit(f"--growth-n must be >= 0, got {a.growth_n}")
    if a.growth_n and a.growth_shard_samples < 1:  # checked now: the growth part runs after the pipeline
        raise SystemExit(f"--growth-shard-samples must be >= 1, got {a.growth_shard_samples}")
    if a.preset and a.skip_pipeline:
        raise SystemExit("--preset applies to a pipeline run: not with --skip-pipeline")
    if a.preset:  # checked before the previous clone is deleted, as the clone's params.yaml will take it
        try:
            preset.merge(yaml12.load_file(REPO / "params.yaml"), preset.load_preset(a.preset),
                         f"params.yaml + {a.preset}")
        except ParamsError as e:
            raise SystemExit(f"--preset {a.preset}: {e}") from None
    doc["preset"] = str(a.preset) if a.preset else None
    doc["goal_minutes"] = 10 if a.preset else 40
    if (a.resume or a.skip_pipeline) and not (a.workdir / CLONE_MARK).exists():
        raise SystemExit(f"{a.workdir}: no pipeline clone of this benchmark there; run without "
                         "--resume/--skip-pipeline first")
    if a.skip_pipeline and a.out.exists():  # keep the pipeline figures of the file it updates
        doc["pipeline"] = json.loads(a.out.read_text()).get("pipeline")
    if not a.skip_pipeline:
        if not a.resume:
            if a.workdir.exists():
                if not (a.workdir / CLONE_MARK).exists():
                    raise SystemExit(f"{a.workdir} exists and is not a clone this benchmark made: "
                                     "choose another --workdir (it would be deleted)")
                shutil.rmtree(a.workdir)
            subprocess.run(["git", "clone", "--quiet", str(REPO), str(a.workdir)], check=True)
            (a.workdir / CLONE_MARK).write_text("made by benchmarks/bench_pipeline_cpu.py; deleted by its next run\n")
            if a.preset:
                subprocess.run([sys.executable, "-m", "eyas.pipeline.preset", str(a.preset.resolve()), "--write",
                                "params.yaml"], cwd=a.workdir, check=True)
        doc["pipeline"] = pipeline(a.workdir, resume=a.resume)
        doc["within_goal"] = doc["pipeline"]["total_minutes"] <= doc["goal_minutes"]
    if a.growth_n:
        doc["extract_growth"] = extract_growth(a.workdir, a.growth_n, a.growth_shard_samples)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
