#!/usr/bin/env bash
# The test suite, in two tiers (tests/conftest.py marks them):
#   unit  (`pytest -m unit`): every test that needs no vLLM server, no external binary
#         (haproxy, prometheus, kubectl, docker, NVIDIA's libnccl) and no GPU;
#   rest  (`pytest -m "not unit"`): the real-vLLM e2e modules, the external tools, Docker,
#         the real-libnccl tests (the doctor's no-GPU run among them), GPU.
#
#   bash scripts/test.sh          install (scripts/setup.sh, idempotent), the unit tier, and
#                                 only if it passed, the rest: what CI runs (.ci/run)
#   bash scripts/test.sh --unit   the unit tier alone, no install (development; run
#                                 scripts/setup.sh once first)
# Further arguments go to pytest in each tier (e.g. `--unit -k registry`, `tests/unit`,
# `tests/unit/test_x.py`); the tiers select by marker, the folders (tests/unit, e2e, deploy) follow them.
# A tier that selects no test (pytest's exit 5) is not a failure; any failed test is.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all
if [ "${1:-}" = "--unit" ]; then
  mode=unit
  shift
fi
[ "$mode" = unit ] || bash scripts/setup.sh

tier() {  # tier NAME MARKER-EXPRESSION [pytest args...]
  local name=$1 expr=$2 rc=0 t0=$SECONDS
  shift 2
  echo "=== tier $name: pytest -m \"$expr\" $*"
  .venv/bin/python -m pytest -q -p no:cacheprovider -m "$expr" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "=== tier $name: no test selected here"
    rc=0
  fi
  echo "=== tier $name: exit $rc after $((SECONDS - t0)) s"
  return "$rc"
}

# The unit tier waits more than it computes (servers on loopback, deadlines, subprocesses: ~3 min
# of CPU in ~6.5 min serially on 2 cores), so it runs in 4 pytest-xdist workers; XPYD_TEST_WORKERS=0
# runs it in one process (e.g. to read a test's output in order).
workers="${XPYD_TEST_WORKERS:-4}"
unit_args=()
[ "$workers" = 0 ] || unit_args=(-n "$workers")
if ! tier unit "unit" "${unit_args[@]}" "$@"; then
  echo "=== the unit tier failed: the rest does not run" >&2
  exit 1
fi
[ "$mode" = unit ] && exit 0
tier rest "not unit" "$@"
