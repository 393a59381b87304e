#!/usr/bin/env bash
# The GPU profile (presets/h200.yaml): the default DAG and the fine-tune comparison at full scale on a
# GPU machine.
#   bash dev/gpu/gpu_profile.sh            # with DVC: one experiment, `dvc exp run -n h200 -S ... dvc.yaml
#                                          # finetune/dvc.yaml` (both pipelines; docs/experiments.md)
#   bash dev/gpu/gpu_profile.sh STAGE ...  # without DVC: the preset is merged into params.yaml and the
#                                          # pipelines' stage commands run in DAG order (scripts/run_dag.py)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -eq 0 ] && command -v dvc >/dev/null; then
  # shellcheck disable=SC2046  # one -S key=value pair per word, by construction (eyas/pipeline/preset.py)
  exec dvc exp run -n h200 $(python3 -m eyas.pipeline.preset presets/h200.yaml) dvc.yaml finetune/dvc.yaml
fi
python3 -m eyas.pipeline.preset presets/h200.yaml --write params.yaml
exec python3 scripts/run_dag.py "$@"
