#!/usr/bin/env bash
# The external tools some tests run, from Debian's packages: haproxy (the load balancer in
# front of the proxies in the multinode test and `haproxy -c` of its config), prometheus
# (scrapes a running cluster in the monitoring e2e test) and kubectl (`kubectl kustomize` of
# configs/k8s; Debian's package is kubernetes-client). Idempotent: a tool already on the
# machine is kept. Only the binaries: no service is started or enabled.
#
# It never fails the install itself: a tool it cannot install (no root, no apt, no network)
# is reported here. The tests that need it then skip, saying so, on a developer's machine,
# and FAIL where CI=true (tests/conftest.py), so CI cannot pass without them.
set -uo pipefail
TOOLS=(haproxy prometheus kubectl)
declare -A PACKAGE=([haproxy]=haproxy [prometheus]=prometheus [kubectl]=kubernetes-client)

have() {  # as tests/conftest.py's find_tool: the PATH, then Debian's bin and sbin folders
  command -v "$1" >/dev/null 2>&1 && return 0
  local d
  for d in /usr/sbin /usr/local/sbin /usr/bin /usr/local/bin; do
    [ -x "$d/$1" ] && return 0
  done
  return 1
}

report() {  # the verdict, one line per tool
  local tool
  for tool in "${TOOLS[@]}"; do
    if have "$tool"; then
      echo "setup_system: $tool: installed"
    elif [ "${CI:-}" = true ]; then
      echo "setup_system: $tool: MISSING — CI=true, so the tests that need it will FAIL" >&2
    else
      echo "setup_system: $tool: missing — the tests that need it will skip, saying so" >&2
    fi
  done
}

missing=()
for tool in "${TOOLS[@]}"; do
  have "$tool" || missing+=("${PACKAGE[$tool]}")
done
if [ ${#missing[@]} -eq 0 ]; then
  report
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_system: no apt-get here to install ${missing[*]}" >&2
  report
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "setup_system: not root and no sudo: cannot install ${missing[*]}" >&2
    report
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
log=/tmp/xpyd-apt.log
# Only the binaries: no services are started or enabled (policy-rc.d refuses them).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod +x "$policy" && created_policy=1
fi
echo "setup_system: installing ${missing[*]} (apt-get; log: $log)"
# A machine's package lists may be stale or absent: update once when the install fails.
if ! $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
  { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; } >>"$log" 2>&1 ||
    { echo "setup_system: installing ${missing[*]} failed; the end of $log:" >&2; tail -n 5 "$log" >&2; }
fi
[ "$created_policy" = 1 ] && $SUDO rm -f "$policy"
report
exit 0
