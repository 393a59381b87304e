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
# A team's server (docs/team.md): EYAS_MLFLOW_BACKEND=postgresql+psycopg2://user@host:5432/mlflow (checked
# first: a refused connection or a wrong password stops here, naming the URL) and
# EYAS_MLFLOW_ARTIFACTS=/mnt/team/mlartifacts (a shared path).
set -euo pipefail
ROOT="${EYAS_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}"
ROOT="$(cd "$ROOT" && pwd -P)"
HOST="${EYAS_MLFLOW_HOST:-127.0.0.1}"
PORT="${EYAS_MLFLOW_PORT:-5000}"
WORKERS="${EYAS_MLFLOW_WORKERS:-2}"
DB="${EYAS_MLFLOW_BACKEND:-sqlite:///$ROOT/mlflow.db}"   # four slashes: an absolute path
ARTIFACTS="${EYAS_MLFLOW_ARTIFACTS:-$ROOT/mlartifacts}"
die() { echo "mlflow_server.sh: error: $*" >&2; exit 1; }
SHOWN="$(cd "$ROOT" && python3 -c 'import sys; from eyas.tracking.team import safe_uri; print(safe_uri(sys.argv[1]))' "$DB")"
[[ "$PORT" =~ ^[0-9]+$ ]] && (( PORT >= 1 && PORT <= 65535 )) || die "EYAS_MLFLOW_PORT='$PORT' is not a port (1-65535)"
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || die "EYAS_MLFLOW_WORKERS='$WORKERS' is not a positive number of workers"
# the server's own database: a SQLAlchemy URL, not a server's http:// or a file store's path
case "$DB" in
  sqlite:///*|postgresql*://*|postgres://*|mysql*://*|mssql*://*) ;;
  *) die "EYAS_MLFLOW_BACKEND=$SHOWN is not a database URL: give sqlite:////abs/path/mlflow.db or
  postgresql+psycopg2://user@host:5432/mlflow (an http:// URL is what stages use to reach this server:
  MLFLOW_TRACKING_URI; docs/team.md)" ;;
esac
# a database that refuses, or a wrong password: one clear line naming the URL, not a traceback
(cd "$ROOT" && python3 -m eyas.tracking.team check-store "$DB" >/dev/null) ||
  die "EYAS_MLFLOW_BACKEND=$SHOWN cannot be used (above); nothing was started"
# the artifacts directory, once the database answered (nothing is created for a server that never starts)
[[ -e "$ARTIFACTS" && ! -d "$ARTIFACTS" ]] && die "EYAS_MLFLOW_ARTIFACTS=$ARTIFACTS is a file, not a directory"
mkdir -p "$ARTIFACTS" 2>/dev/null && [[ -w "$ARTIFACTS" ]] ||
  die "EYAS_MLFLOW_ARTIFACTS=$ARTIFACTS cannot be created or written (a read-only or unmounted share?): fix the path or its permissions"

# schema first, in one process (creating or migrating it from several at once fails)
if ! UPGRADE="$(cd "$ROOT" && mlflow db upgrade "$DB" 2>&1)"; then
  echo "$UPGRADE" | tail -n 5 | python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); from eyas.tracking.team import safe_uri; sys.stderr.write(safe_uri(sys.stdin.read()))' "$ROOT"
  die "'mlflow db upgrade $SHOWN' failed (its last lines above)"
fi

cat <<EOF
MLflow server for $ROOT
  backend   $SHOWN
  artifacts $ARTIFACTS
  UI        http://$HOST:$PORT
In every shell that runs the pipeline or the queue:
  export MLFLOW_TRACKING_URI=http://$HOST:$PORT
EOF
cd "$ROOT"
exec mlflow server --backend-store-uri "$DB" --artifacts-destination "$ARTIFACTS" \
  --host "$HOST" --port "$PORT" --workers "$WORKERS"
