"""DVC stage `export-gguf@<drafter>`: the drafter as a GGUF that llama.cpp serves
(`llama-server -m models/target_gguf/target.gguf -md models/<drafter>.gguf --spec-type draft-eagle3`),
written by llama.cpp's own converter from `models/<drafter>/` with `--target-model-dir
models/target_gguf` (eyas/formats/gguf.py), at the precision of `target.dtype` as eval runs it.
Reads params `target.dtype`; writes `models/<drafter>.gguf`.
Run: `python -m stages.export_gguf scratch`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from eyas.config import load_params
from eyas.formats.gguf import OUTTYPES, convert
from eyas.tracking import start_stage_run
from stages.common import TARGET_GGUF


def main(name: str) -> None:
    p = load_params()
    with start_stage_run(f"export-gguf@{name}", p) as tracker:
        out = convert(Path("models", name), Path("models", f"{name}.gguf"), outtype=OUTTYPES[p.target.dtype],
                      target_model_dir=TARGET_GGUF)
        tracker.log_metrics({"gguf_bytes": float(out.stat().st_size)})
        print(f"export-gguf@{name}: {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m stages.export_gguf <drafter: scratch|finetune>")
    main(sys.argv[1])
