#!/usr/bin/env bash
# A local MLflow tracking server for eyas: one process owns the store, so parallel queue workers
# (`dvc queue start -j N`) never race on the sqlite file (docs/dvc-mlflow.md §2, §3).
#
#   scripts/mlflow_server.sh            # foreground; Ctrl-C stops it
#   # in every shell that runs stages (before `dvc repro`, `dvc exp run`, `dvc queue start`):
#   export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
#
# Store: the same files eyas uses without a server, so runs from before and after share one UI:
#   backend    sqlite:////<repo>/mlflow.db
#   artifacts  <repo>/mlartifacts  (new experiments: mlflow-artifacts:/, served from here; the
#              `eyas` experiment made without a server keeps its absolute <repo>/mlartifacts path)
# Overrides: EYAS_MLFLOW_HOST (127.0.0.1), EYAS_MLFLOW_PORT (5000), EYAS_MLFLOW_WORKERS (2),
# EYAS_ROOT (the repo; default: this script's parent directory). Loopback only by default:
# --host 0.0.0.0 opens it to the network with no access control (docs/dvc-mlflow.md §8).
set -euo pipefail
ROOT="${EYAS_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}"
ROOT="$(cd "$ROOT" && pwd -P)"
HOST="${EYAS_MLFLOW_HOST:-127.0.0.1}"
PORT="${EYAS_MLFLOW_PORT:-5000}"
WORKERS="${EYAS_MLFLOW_WORKERS:-2}"
DB="sqlite:///$ROOT/mlflow.db"   # four slashes: an absolute path
ARTIFACTS="$ROOT/mlartifacts"
mkdir -p "$ARTIFACTS"

# schema first, in one process (creating or migrating it from several at once fails)
(cd "$ROOT" && mlflow db upgrade "$DB" >/dev/null 2>&1) || {
  echo "mlflow_server.sh: 'mlflow db upgrade $DB' failed" >&2
  exit 1
}

cat <<EOF
MLflow server for $ROOT
  backend   $DB
  artifacts $ARTIFACTS
  UI        http://$HOST:$PORT
In every shell that runs the pipeline or the queue:
  export MLFLOW_TRACKING_URI=http://$HOST:$PORT
EOF
cd "$ROOT"
exec mlflow server --backend-store-uri "$DB" --artifacts-destination "$ARTIFACTS" \
  --host "$HOST" --port "$PORT" --workers "$WORKERS"
