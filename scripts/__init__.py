"""Tools and benchmarks, run from the repository root as `python -m scripts.NAME`."""
