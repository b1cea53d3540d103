#!/usr/bin/env bash
# Mutation testing (mutmut 3) of the modules where a silent break costs users most, against the
# fast (unit) tier. Needs the `mutation` extra: `.venv/bin/pip install -e '.[test,mutation]'`;
# installs nothing itself.
#
#   scripts/mutation.sh                    # every module in MODULES below, one after another
#   scripts/mutation.sh xpyd_wire/discovery.py connector/buffer.py
#   JOBS=2 scripts/mutation.sh ...         # mutmut children (default 1: the dev box is shared)
#   FRESH=1 scripts/mutation.sh ...        # forget earlier results (else mutmut reuses them)
#   SCORE_ONLY=1 scripts/mutation.sh ...   # print the scores of the last runs, run nothing
#   RECHECK=1 scripts/mutation.sh ...      # after adding tests: rerun only the mutants not yet killed
#
# Each module runs in its own work folder, .mutation/<module>/ (git-ignored): a copy of the tree
# with a pyproject whose [tool.mutmut] mutates that one module and selects only that module's
# tests, so a run costs minutes, not the whole suite per mutant. mutmut copies the code once more
# into <work>/mutants/ and runs the tests from there.
#
# Score = (killed + timeout) / (total - equivalent - skipped); a mutant whose test process crashed
# (segfault) or was never checked counts as not killed. Equivalent mutants (no test can
# tell them apart from the original) are listed, one reason each, in scripts/mutation_equivalent.txt.
# The survivors still counted against the score are written to .mutation/<module>/survivors.txt;
# `cd .mutation/<module> && mutmut show NAME` prints one's diff.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
MUTMUT="$(dirname "$PY")/mutmut"
JOBS="${JOBS:-1}"
EQUIV="$ROOT/scripts/mutation_equivalent.txt"

# module -> the unit tests that exercise it (run with -m unit; mutmut then runs, per mutant, only
# the tests that called the mutated function).
declare -A TESTS=(
  [xpyd_wire/request_id.py]="tests/unit/test_request_id.py tests/unit/test_wire_vectors.py tests/unit/test_wire_boundaries.py"
  [xpyd_wire/secret_file.py]="tests/unit/test_connector_secret_files.py tests/unit/test_proxy_secret_files.py"
  [xpyd_wire/kv_transfer.py]="tests/unit/test_kv_transfer.py tests/unit/test_wire_vectors.py tests/unit/test_wire_boundaries.py tests/unit/test_connector_protocol_version.py"
  [xpyd_wire/kv_events.py]="tests/unit/test_kv_events.py tests/unit/test_wire_vectors.py tests/unit/test_wire_boundaries.py"
  [xpyd_wire/discovery.py]="tests/unit/test_proxy_discovery.py tests/unit/test_wire_vectors.py tests/unit/test_wire_boundaries.py tests/unit/test_connector_registration.py"
  [connector/scheduler.py]="tests/unit/test_connector_scheduler.py"
  [connector/buffer.py]="tests/unit/test_connector_buffer.py tests/unit/test_connector_units.py tests/unit/test_connector_staging.py tests/unit/test_connector_get_store.py"
  [connector/producer.py]="tests/unit/test_connector_producer.py tests/unit/test_connector_engine.py tests/unit/test_connector_layerwise.py tests/unit/test_connector_first_contact.py tests/unit/test_connector_tp.py"
  [connector/consumer.py]="tests/unit/test_connector_consumer.py tests/unit/test_connector_engine.py tests/unit/test_connector_tp.py"
  [proxy/registry.py]="tests/unit/test_proxy_units.py tests/unit/test_proxy_registrants.py tests/unit/test_proxy_discovery.py"
  [proxy/routing/kv_events.py]="tests/unit/test_kv_events.py"
  [proxy/dispatch/first_token.py]="tests/unit/test_proxy_first_token.py"
  [proxy/dispatch/events.py]="tests/unit/test_proxy_first_token.py"
)
# The marker expression per module (default "unit"). discovery: its sync tests only; the async ones
# drive a whole proxy over ZMQ (seconds each) and would make a run take an hour on 2 cores.
# registry: the same; its sync tests (tests/unit/test_proxy_units.py) drive every rule directly.
declare -A MARKS=(
  [xpyd_wire/discovery.py]="unit and not asyncio"
  [proxy/registry.py]="unit and not asyncio"
)
# Modules whose tests leave threads and zmq/torch state behind: mutmut forks each mutant from a fork
# server that never ran a test (mutmut's default forks from its own process after the stats run,
# and those children crashed, counted as segfaults, not verdicts).
declare -A ISOLATION=(
  [connector/producer.py]=forkserver
  [connector/consumer.py]=forkserver
)
# proxy/dispatch/*.py (the dispatcher, split in modules): the dispatch and failure tests, the tests
# written for their mutants (tests/unit/test_proxy_dispatch_*.py), and the few tests elsewhere that
# drive a path these miss: P alone for one token, the stream lead's and the neutral id's pure
# functions. Changing this list makes mutmut forget a module's results.
for m in call continuation decode disaggregated dispatcher local relay rescue rewrite; do
  TESTS[proxy/dispatch/$m.py]="tests/unit/test_proxy_dispatch_prefill.py tests/unit/test_proxy_dispatch_paths.py
    tests/unit/test_proxy_dispatch_rescue.py tests/unit/test_proxy_dispatch_relay.py
    tests/unit/test_proxy_dispatch.py tests/unit/test_proxy_failures.py tests/unit/test_proxy_io.py
    tests/unit/test_proxy_first_token.py::test_one_token_is_all_from_p_and_d_is_not_asked
    tests/unit/test_proxy_first_token.py::test_one_token_chat_is_all_from_p_without_a_transfer
    tests/unit/test_proxy_units.py::test_judge_lead tests/unit/test_proxy_units.py::test_judge_lead_parses_no_more_than_its_cap
    tests/unit/test_proxy_units.py::test_relay_error_event_starts_on_an_event_boundary
    tests/unit/test_proxy_security.py::test_rewrite_whole_body_and_every_split_of_the_id
    tests/unit/test_proxy_security.py::test_rewrite_holds_back_only_a_proper_prefix_of_the_id
    tests/unit/test_proxy_security.py::test_event_boundary"
done
# continuation.py is the first-token path's D side: the first-token tests drive it.
TESTS[proxy/dispatch/continuation.py]+=" tests/unit/test_proxy_first_token.py"
MODULES=(xpyd_wire/request_id.py xpyd_wire/secret_file.py xpyd_wire/kv_transfer.py xpyd_wire/kv_events.py
         xpyd_wire/discovery.py connector/scheduler.py connector/buffer.py connector/producer.py
         connector/consumer.py proxy/registry.py proxy/routing/kv_events.py proxy/dispatch/first_token.py
         proxy/dispatch/events.py proxy/dispatch/dispatcher.py proxy/dispatch/disaggregated.py proxy/dispatch/rescue.py proxy/dispatch/relay.py
         proxy/dispatch/continuation.py proxy/dispatch/decode.py proxy/dispatch/local.py proxy/dispatch/call.py
         proxy/dispatch/rewrite.py)

# What the tests read besides the code (some read configs/, docs/, the compose file).
TREE=(proxy connector xpyd_wire tests scripts configs docs docker-compose.yml README.md mkdocs.yml)

main() {
[ -x "$MUTMUT" ] || { echo "mutmut not found at $MUTMUT: pip install -e '.[mutation]'" >&2; exit 2; }
[ $# -gt 0 ] && MODULES=("$@")

summary=()
for mod in "${MODULES[@]}"; do
  tests="${TESTS[$mod]:-}"
  [ -n "$tests" ] || { echo "no tests listed for $mod in $0" >&2; exit 2; }
  work="$ROOT/.mutation/${mod//\//__}"
  echo "== $mod (tests: -m '${MARKS[$mod]:-unit}' $tests)"
  if [ "${SCORE_ONLY:-0}" != 1 ]; then
  [ "${FRESH:-0}" = 1 ] && rm -rf "$work"
  mkdir -p "$work"
  # The tree as it is now (tracked and untracked files, no caches); mutmut notices changed functions.
  for d in "${TREE[@]}"; do
    rm -rf "${work:?}/$d" && cp -a "$ROOT/$d" "$work/$d"
  done
  find "$work" -path "$work/mutants" -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
  "$PY" - "$ROOT/pyproject.toml" "$work/pyproject.toml" "$mod" "${TREE[*]}" "${MARKS[$mod]:-unit}" "${ISOLATION[$mod]:-fork}" $tests <<'EOF'
import re, sys
src, dst, mod, tree, marks, isolation, *tests = sys.argv[1:]
tree = tree.split()
text = open(src).read()
text = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[|\Z)", "", text)  # ours replaces any in the tree
pkg = mod.split("/")[0]
sel = ["-m", marks, "-p", "no:cacheprovider", *tests]
text += f"""
[tool.mutmut]
source_paths = ["{pkg}"]
only_mutate = ["{mod}"]
also_copy = {[p for p in tree if p != pkg and p != "tests"]!r}
pytest_add_cli_args_test_selection = {sel!r}
use_git_change_detection = false
process_isolation = "{isolation}"
""".replace("'", '"')
open(dst, "w").write(text)
EOF
  names=()
  if [ "${RECHECK:-0}" = 1 ] && [ -f "$work/mutants/$mod.meta" ]; then
    # Only the mutants not killed last time (tests were added; a killed one stays killed while the
    # module is unchanged), less the listed equivalents. mutmut skips mutants that have a result unless named.
    mapfile -t names < <("$PY" -c 'import json,sys; m=json.load(open(sys.argv[1]))["exit_code_by_key"]
eq={l.split("#",1)[0].strip() for l in open(sys.argv[2])}
print("\n".join(k for k, v in m.items() if v not in (1, 3, -24, 24, 36, 152, 255) and k not in eq))' "$work/mutants/$mod.meta" "$EQUIV")
    [ -n "${names[0]:-}" ] || names=("__none__")  # print() of nothing is one empty line
  fi
  if [ "${names[0]:-}" != "__none__" ]; then
  (cd "$work" && "$MUTMUT" run --max-children "$JOBS" "${names[@]}" >"$work/run.log" 2>&1) || {
    echo "mutmut failed for $mod, see $work/run.log" >&2; tail -20 "$work/run.log" >&2; exit 1; }
  fi
  fi
  line="$("$PY" - "$work" "$mod" "$EQUIV" <<'EOF'
import json, subprocess, sys
from pathlib import Path
work, mod, equiv_path = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
equiv = set()
for raw in open(equiv_path):
    name = raw.split("#", 1)[0].strip()
    if name:
        equiv.add(name)
meta = json.load(open(work / "mutants" / (mod + ".meta")))
codes = meta["exit_code_by_key"]
prefix = mod[:-3].replace("/", ".") + "."
# mutmut's own exit-code meaning (mutmut/__main__.py status_by_exit_code)
killed = timeout = survived = no_tests = skipped = other = 0
left = []
for name, code in sorted(codes.items()):
    if name in equiv:
        continue
    if code in (1, 3):  # 1: a test failed; 3: pytest's internal error on the mutant
        killed += 1
    elif code in (-24, 24, 36, 152, 255):  # timeouts (SIGXCPU / time limit): the mutant hangs a test
        timeout += 1
    elif code == 0:
        survived += 1; left.append(f"{name}  survived")
    elif code in (5, 33):
        no_tests += 1; left.append(f"{name}  no tests")
    elif code == 34:
        skipped += 1
    else:
        other += 1; left.append(f"{name}  exit {code}")  # not checked (None), suspicious, segfault
n_equiv = sum(1 for n in codes if n in equiv)
total = len(codes) - n_equiv - skipped
score = 100.0 * (killed + timeout) / total if total else 100.0
(work / "survivors.txt").write_text("".join(x + "\n" for x in left))
print(f"{mod}: {score:5.1f}%  killed {killed + timeout} / {total} (mutants {len(codes)}, equivalent {n_equiv}, "
      f"survived {survived}, no tests {no_tests}, timeout {timeout}, other {other})")
EOF
)"
  echo "$line"
  summary+=("$line")
done
echo
echo "== mutation score (killed / (total - equivalent)), unit tier"
printf '%s\n' "${summary[@]}"
}

main "$@"  # the whole script is read before it runs: editing it meanwhile cannot derail a run
