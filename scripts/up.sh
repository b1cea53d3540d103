#!/usr/bin/env bash
# Bring up proxy + 1 prefill + 1 decode vLLM (CPU build, tiny local model) on
# 127.0.0.1, send one completion through the proxy, keep running until Ctrl-C.
# Pass --once to stop after the first answer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/cluster.py up "$@"
