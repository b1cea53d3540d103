#!/usr/bin/env bash
# System packages some tests use (Debian): haproxy (the load balancer in front of the
# proxies in the multinode test) and prometheus (scrapes a running cluster in the
# monitoring e2e test). Best effort and idempotent: a package that cannot be installed
# (no root, no apt, no network) is reported and the tests that need it skip themselves
# saying so; this script never fails the setup.
set -uo pipefail
PKGS=(haproxy prometheus)
missing=()
for pkg in "${PKGS[@]}"; do
  command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_system: no apt-get; tests needing ${missing[*]} will skip" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "setup_system: not root and no sudo; tests needing ${missing[*]} will skip" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
# Only the binaries: no services are started or enabled (policy-rc.d refuses them).
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod +x "$policy" && created_policy=1
fi
if ! $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/tmp/xpyd-apt.log 2>&1; then
  $SUDO apt-get update -q >>/tmp/xpyd-apt.log 2>&1 &&
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >>/tmp/xpyd-apt.log 2>&1 ||
    echo "setup_system: installing ${missing[*]} failed (see /tmp/xpyd-apt.log); tests needing them will skip" >&2
fi
[ "$created_policy" = 1 ] && $SUDO rm -f "$policy"
exit 0
