#!/usr/bin/env bash
# Bring up an xPyD topology from configs/topologies/ (default 1p1d: proxy + 1 prefill + 1 decode
# vLLM, CPU build, tiny local model) on 127.0.0.1, send one completion through the proxy, keep
# running until Ctrl-C or SIGTERM, which stop every process it started.
#   bash scripts/up.sh                 # 1p1d
#   bash scripts/up.sh 1p2d --once     # another layout; stop after the first answer
# Everything after the topology goes to `xpyd launch up` (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
topology=1p1d
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then topology=$1; shift; fi
bash scripts/setup.sh
exec .venv/bin/python -m xpyd_deploy launch up "$topology" "$@"
