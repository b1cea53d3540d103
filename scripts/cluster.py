#!/usr/bin/env python3
"""Bring up a local xPyD system: proxy + prefill + decode vLLM (CPU build). Kept for old command
lines: the launcher (scripts/launch.py, configs/topologies/1p1d.yaml) does this now. The servers
the tests and benchmarks start come from tests/support/cluster.py.

    python -m scripts.cluster up            # = python -m scripts.launch up 1p1d
    python -m scripts.cluster up --once     # = python -m scripts.launch up 1p1d --once
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from scripts.launch import main as launch
from tests.support.cluster import DEFAULT_MODEL, ROOT


def up(args: argparse.Namespace) -> int:
    subprocess.run([sys.executable, "-m", "scripts.make_tiny_model", "--out", str(DEFAULT_MODEL)], check=True,
                   cwd=ROOT)
    argv = ["up", "1p1d", "--log-dir", args.log_dir, "--timeout", str(args.timeout)]
    return launch(argv + (["--once"] if args.once else []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="proxy + 1 prefill + 1 decode on 127.0.0.1 (= scripts/launch.py up 1p1d)")
    u.add_argument("--log-dir", default=str(ROOT / ".logs"))
    u.add_argument("--timeout", type=float, default=300)
    u.add_argument("--once", action="store_true", help="stop after the first answer")
    args = ap.parse_args()
    if args.cmd == "up":
        return up(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
