"""DVC stage `identify-inputs`: the identity of the target and of the data source, as files.

Checks the whole params file (every section: the first stage `dvc repro` runs, so a wrong key
anywhere fails before any compute); reads params `target`, `data.source`, `data.code_prompts`, the
target's tokenizer, chat template and config files (or the embedded GGUF, or the pinned hub
revision) and the data source;
writes `data/inputs/target.json` and `data/inputs/source.json` (eyas/pipeline/provenance.py). It is
`always_changed` (DVC cannot hash files outside the repo by itself), cheap, and rewrites a file
only when its contents change, so the stages that depend on these files rerun exactly when the
target or the data source changed. No MLflow run: it runs on every `dvc repro`.
Run: `python -m stages.identify_inputs`.
"""

from __future__ import annotations

import logging

from eyas.params.full import load_params
from eyas.params.schema import ParamsError
from eyas.pipeline.provenance import identify_inputs
from eyas.pipeline.runlock import hold


def main() -> None:
    hold("identify-inputs")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:  # the whole params file is checked here, the first stage of every run: one line naming the key
        p = load_params()
    except ParamsError as e:
        raise SystemExit(f"identify-inputs: error: {e}") from None
    ids = identify_inputs(p)
    t = ids["target"]
    print(f"identify-inputs: target {t['kind']} {t['path']} ({len(t['files'])} files hashed, "
          f"revision {t['revision']}); source {ids['source']['source']}")


if __name__ == "__main__":
    main()
