"""DVC stage `export-gguf@<drafter>`: the drafter as a GGUF that llama.cpp serves
(`llama-server -m models/target_gguf/target.gguf -md models/<drafter>.gguf --spec-type draft-eagle3`),
written by llama.cpp's own converter from `models/<drafter>/` with `--target-model-dir
models/target_gguf` (eyas/export/gguf.py), at the precision of `target.dtype` as eval runs it, then
read back and checked against the checkpoint (target layers, d2t, sizes, norm flags, RoPE and every
other field that changes the math, weights: eyas.export.gguf.check_against) and the target's llama.cpp
graph (a target layer id L only where it fills it: eyas.export.llamacpp_nextn); a mismatch, or a file
that is not an eagle3 GGUF (a converter that wrote a plain llama one), deletes the file and fails the stage.
Reads params `target.dtype`; writes `models/<drafter>.gguf` and its SHA-256, `models/<drafter>.gguf.sha256`
(checked before it is served).
Run: `python -m stages.export_gguf scratch`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from eyas.export.gguf import OUTTYPES, GGUFReadError, ServeMismatchError, convert, require_served_as_trained
from eyas.export.gguf_fields import digest_path
from eyas.io import read_json
from eyas.params import target as target_schema
from eyas.params.schema import load_sections
from eyas.pipeline.provenance import check
from eyas.pipeline.runlock import hold
from eyas.tracking.runs import start_stage_run
from stages.common import TARGET_GGUF


def main(name: str) -> None:
    hold(f"export-gguf@{name}")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema)
    with start_stage_run(f"export-gguf@{name}", p) as tracker:
        check(TARGET_GGUF, p, reader=f"export-gguf@{name}")  # a target-gguf of another target: refused
        out = convert(Path("models", name), Path("models", f"{name}.gguf"), outtype=OUTTYPES[p.target.dtype],
                      target_model_dir=TARGET_GGUF)
        target = read_json(TARGET_GGUF / "config.json")
        try:  # the file as llama.cpp will load it, against the checkpoint it came from and the target's graph
            info = require_served_as_trained(out, Path("models", name), target["num_hidden_layers"],
                                             target_arch=(target.get("architectures") or [None])[0])
        except (ServeMismatchError, GGUFReadError) as e:  # served otherwise, or not an eagle3 file at all
            out.unlink()
            digest_path(out).unlink(missing_ok=True)
            raise SystemExit(str(e)) from None
        print(f"export-gguf@{name}: target layers {info['target_layers']}, draft vocab {info['draft_vocab_size']}, "
              f"norm_before_residual {info['norm_before_residual']}, norm_before_fc {info['norm_before_fc']}")
        tracker.log_metrics({"gguf_bytes": float(out.stat().st_size)})
        print(f"export-gguf@{name}: {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m stages.export_gguf <drafter: scratch|finetune>")
    main(sys.argv[1])
