#!/usr/bin/env bash
# Installs what the side-by-side benchmarks need beyond scripts/setup.sh (idempotent):
# vllm-router 0.1.17 (a Rust binary in a wheel), matplotlib and py-spy into ./.venv (the
# `bench` optional dependencies), and guidellm in a venv of its own, ./.venv-guidellm:
# guidellm pins click ~=8.4 (vLLM's tree has 8.5) and needs torch, which is pinned to the
# CPU build here (an unpinned resolve pulls several GB of CUDA wheels).
# Used by scripts/bench_load.py (--client guidellm|both) and scripts/bench_proxy.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${XPYD_VENV:-.venv}
PY=${PYTHON:-python3}
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install -e ".[bench]"
if [ "${XPYD_NO_GUIDELLM:-}" != 1 ]; then
  GL=.venv-guidellm
  [ -x "$GL/bin/python" ] || "$PY" -m venv "$GL"
  GPIP="$GL/bin/python -m pip --disable-pip-version-check -q"
  $GPIP install "torch==2.13.0"
  $GPIP install "guidellm==0.8.1" "torch==2.13.0"
  "$GL/bin/guidellm" --version
fi
