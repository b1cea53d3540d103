#!/usr/bin/env bash
# The test suite: installs what it needs (scripts/setup.sh, idempotent), then runs
# every test. GPU tests skip themselves without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
