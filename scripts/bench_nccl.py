#!/usr/bin/env python3
"""``scripts/bench_transport.py --device cuda`` runs this: the benchmark itself lives in
``connector/tools/gpu_bench.py`` (``xpyd doctor`` measures with the same code)."""

from __future__ import annotations

import sys

from connector.tools.gpu_bench import main, run  # noqa: E402,F401  (bench_transport calls run)

if __name__ == "__main__":
    sys.exit(main())
