"""scripts/bench_e2e.py --runs starts each run as a child process, from the repository root:
that child must import the harness (tests.support), as a file run it could not."""

import subprocess

from scripts.bench_e2e import ROOT, child_command


def test_a_run_of_runs_starts_and_imports_the_harness():
    cmd = child_command(["--quick", "--runs", "3", "--json", "x.json", "--log-dir", "logs", "--ttft-tokens", "4000"])
    assert "--runs" not in cmd and "--json" not in cmd and "--log-dir" not in cmd
    assert cmd[-2:] == ["--ttft-tokens", "4000"]
    # The child as run_many starts it (cwd: the repository), asked for its help only.
    done = subprocess.run([*cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--ttft-tokens" in done.stdout
