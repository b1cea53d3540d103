#!/usr/bin/env python3
"""Fetch the real ``libnccl.so.2`` (and its ``nccl.h``) of the NVIDIA NCCL wheels the
real-library tests (tests/unit/test_nccl_real_lib.py) run our binding against, side by side:

    .nccl-wheels/<dist>-<version>/libnccl.so.2
    .nccl-wheels/<dist>-<version>/include/nccl.h

``pip download --no-deps`` of each wheel, then only those two files are unzipped (a wheel
is 190-350 MB; the rest is not needed) and the wheel is deleted. Not installed into the
venv: several versions must sit side by side, and the venv's own NCCL (if any) stays
what torch/vLLM resolved. Idempotent (a complete directory is reused) and safe to run
from two processes at once (a lock file; each version is unpacked into a temporary
directory and renamed into place).

    python -m scripts.nccl_wheels            # fetch all, print one JSON line per version
    python -m scripts.nccl_wheels --check    # exit 1 if any is missing, fetch nothing
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XPYD_NCCL_WHEELS", REPO / ".nccl-wheels"))

# (distribution, version, why this one). The versions torch and vLLM pin, the oldest
# NCCL our binding accepts and the newest on PyPI; checked against PyPI's release lists.
WHEELS: tuple[tuple[str, str, str], ...] = (
    ("nvidia-nccl-cu12", "2.18.1", "oldest NCCL nccl_lib accepts (ncclConfig_t of 2.18)"),
    ("nvidia-nccl-cu12", "2.21.5", "torch 2.5 / 2.6"),
    ("nvidia-nccl-cu12", "2.26.2", "torch 2.7 / 2.8 (trafficClass after splitShare, not reset)"),
    ("nvidia-nccl-cu12", "2.27.5", "torch 2.9 / 2.10"),
    ("nvidia-nccl-cu13", "2.29.7", "torch 2.12 / 2.13 (vLLM 0.32; the oldest vLLM's binding loads)"),
    ("nvidia-nccl-cu13", "2.30.7", "torch 2.14 (vLLM 0.33)"),
    ("nvidia-nccl-cu12", "2.32.3", "newest; what `pip install nvidia-nccl-cu12` gives"),
)
_MEMBERS = {"nvidia/nccl/lib/libnccl.so.2": "libnccl.so.2", "nvidia/nccl/include/nccl.h": "include/nccl.h"}
_PIP_TIMEOUT_S = 600


def target(dist: str, version: str) -> Path:
    return CACHE / f"{dist}-{version}"


def _complete(d: Path) -> bool:
    return all((d / rel).is_file() for rel in _MEMBERS.values())


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_one(dist: str, version: str) -> dict:
    """Make ``target(dist, version)`` complete; returns what it cost (0 when cached).
    Raises RuntimeError naming pip's output when the download fails."""
    d = target(dist, version)
    if _complete(d):
        return {"dist": dist, "version": version, "path": str(d), "cached": True, "bytes": 0, "seconds": 0.0}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=".dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-cache-dir", "-q", "-d", tmp, f"{dist}=={version}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {dist}=={version} failed (rc={r.returncode}): "
                               f"{(r.stderr or r.stdout)[-2000:]}")
        size = wheels[0].stat().st_size
        unpack = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as z:
            names = set(z.namelist())
            for member, rel in _MEMBERS.items():
                if member not in names:
                    raise RuntimeError(f"{wheels[0].name} has no {member}")
                out = unpack / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with z.open(member) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if d.exists():  # an incomplete earlier attempt
            shutil.rmtree(d)
        unpack.rename(d)
    return {"dist": dist, "version": version, "path": str(d), "cached": False, "bytes": size,
            "seconds": round(time.monotonic() - t0, 1)}


def fetch_all(wheels: tuple[tuple[str, str, str], ...] = WHEELS) -> list[dict]:
    with _locked():
        return [fetch_one(dist, version) for dist, version, _ in wheels]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only say whether every version is there")
    args = ap.parse_args()
    if args.check:
        missing = [f"{d}=={v}" for d, v, _ in WHEELS if not _complete(target(d, v))]
        print(json.dumps({"cache": str(CACHE), "missing": missing}))
        return 1 if missing else 0
    for row in fetch_all():
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
