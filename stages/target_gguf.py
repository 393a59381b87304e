"""DVC stage `target-gguf`: the target as llama.cpp reads it.

Writes `models/target_gguf/`: the target's `config.json` and tokenizer files (what llama.cpp's
converter reads through `--target-model-dir` for every drafter GGUF: vocab, layer count, hidden
size) and, with `serve.engine: llamacpp`, `target.gguf`: the weights eyas evaluates, as
transformers loads them (a GGUF target de-quantised), at `target.dtype` (float32 -> f32,
bfloat16 -> bf16, float16 -> f16), written by llama.cpp's own converter (eyas/export/gguf.py), so
the engine serves the very weights eyas' own acceptance is measured on.
`models/target_gguf/fingerprint.json` records the target it came from (export-gguf and the eval check
it: eyas/pipeline/provenance.py). Reads params `target`, `serve.engine`. Run: `python -m stages.target_gguf`.
"""

from __future__ import annotations

import shutil
import time

import torch

from eyas.export.gguf import OUTTYPES, convert, write_target_dir
from eyas.io import write_json
from eyas.params import serve as serve_schema
from eyas.params import target as target_schema
from eyas.params.schema import load_sections
from eyas.pipeline.provenance import FILE as FINGERPRINT
from eyas.pipeline.provenance import record
from eyas.pipeline.runlock import hold
from eyas.target.model import load_target
from eyas.tracking.runs import start_stage_run
from stages.common import TARGET_GGUF


def main() -> None:
    hold("target-gguf")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema, serve_schema)
    with start_stage_run("target-gguf", p) as tracker:
        t0 = time.time()
        target = load_target(p.target.path, p.target.gguf_file, p.target.dtype, p.target.trust_remote_code,
                             device=torch.device("cpu"), revision=p.target.revision)
        shutil.rmtree(TARGET_GGUF, ignore_errors=True)
        serve = p.serve.engine == "llamacpp"
        write_target_dir(target.model, target.tokenizer, TARGET_GGUF, weights=serve)
        if serve:
            convert(TARGET_GGUF, TARGET_GGUF / "target.gguf", outtype=OUTTYPES[p.target.dtype])
            (TARGET_GGUF / "model.safetensors").unlink()
        write_json(TARGET_GGUF / FINGERPRINT, record("target-gguf", p, []))  # checked by its readers
        size = (TARGET_GGUF / "target.gguf").stat().st_size if serve else 0
        tracker.log_metrics({"target_gguf_bytes": float(size), "seconds": time.time() - t0})
        print(f"target-gguf: {TARGET_GGUF} ({'target.gguf ' + str(size) + ' bytes, ' if serve else ''}"
              f"config and tokenizer) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
