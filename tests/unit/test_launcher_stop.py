"""xpyd_deploy/launch.py's escalation when a process group will not stop: SIGKILL after
`stop_grace`, and at once on a second SIGINT/SIGTERM. Real processes (a Python that ignores
SIGTERM, with a child in its group that does too), no vLLM."""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from xpyd_deploy.launch import Launcher, LaunchOptions  # noqa: E402  (xpyd_deploy/launch.py)
from xpyd_deploy.topology import load_topology  # noqa: E402  (xpyd_deploy/topology.py)

# Ignores SIGTERM, as does its child (an ignored signal stays ignored across fork and exec).
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("pids", os.getpid(), child.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _launcher(tmp_path: Path, stop_grace: float) -> tuple[Launcher, io.StringIO]:
    out = io.StringIO()
    return Launcher(load_topology("1p1d"), LaunchOptions(log_dir=tmp_path, stop_grace=stop_grace, out=out)), out


def _spawn_stubborn(launcher: Launcher, name: str = "stubborn"):
    proc = launcher._spawn(name, "P", "http://127.0.0.1:1", [sys.executable, "-c", STUBBORN], {})
    deadline = time.monotonic() + 30
    while "pids" not in proc.log_path.read_text():
        assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.05)
    pids = [int(x) for x in proc.log_path.read_text().split()[1:3]]
    return proc, pids


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if _running(p)]}"
        time.sleep(0.05)


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    launcher, out = _launcher(tmp_path, stop_grace=1.0)
    stubborn, pids = _spawn_stubborn(launcher)
    polite = launcher._spawn("polite", "D", "http://127.0.0.1:2",
                             [sys.executable, "-c", "import time; time.sleep(120)"], {})
    t0 = time.monotonic()
    try:
        launcher.stop_all()
        took = time.monotonic() - t0
    finally:
        for p in (stubborn, polite):
            p.signal_group(signal.SIGKILL)
    text = out.getvalue()
    assert 1.0 <= took < 1.0 + 12, took  # the grace period, then SIGKILL and the wait for it
    assert "stubborn still running after 1s: SIGKILL" in text and "polite still running" not in text
    assert "did not exit" not in text and text.rstrip().endswith("stopped")
    _wait_gone(pids, 5)  # the whole group: the child too
    assert polite.popen.returncode == -signal.SIGTERM and stubborn.popen.returncode == -signal.SIGKILL


def test_a_second_signal_kills_at_once(tmp_path):
    """The first SIGINT only asks (the launcher then stops everything gracefully); a second
    one (SIGTERM here) SIGKILLs every group without waiting for the grace period."""
    launcher, _ = _launcher(tmp_path, stop_grace=60.0)
    stubborn, pids = _spawn_stubborn(launcher)
    restore = launcher.install_signal_handlers()
    try:
        assert signal.getsignal(signal.SIGINT) == launcher._on_signal  # else the kill ends pytest
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while not launcher.stop_requested.is_set():
            assert time.monotonic() < deadline, "the first signal was not handled"
            time.sleep(0.01)
        time.sleep(0.3)
        assert all(_running(p) for p in pids)  # nothing killed on the first signal
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_gone(pids, 5)
    finally:
        restore()
        stubborn.signal_group(signal.SIGKILL)
    assert stubborn.popen.wait(5) == -signal.SIGKILL
