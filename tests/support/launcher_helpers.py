"""Drive `xpyd launch up` the way a user's shell does: a child process,
its output read line by line, signals sent to its PID, and a look at /proc for anything
it left behind. `install_xpyd` installs this checkout as the wheel would (its `xpyd` console
script included) for the tests that run the command users type."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from tests.support.cluster import port_free  # noqa: E402  (tests/support/cluster.py)
from xpyd_deploy.topology import Topology  # noqa: E402  (xpyd_deploy/topology.py)

READY_LINE = "running; Ctrl-C or SIGTERM stops everything"
PACKAGES = ("proxy", "connector", "xpyd_wire", "xpyd_deploy")  # pyproject's [tool.setuptools.packages.find]
# `python -m xpyd_deploy.launch`: the launcher without a console script (this interpreter, this checkout).
LAUNCH_MODULE = (sys.executable, "-m", "xpyd_deploy.launch")


@dataclass(frozen=True)
class InstalledXpyd:
    """This checkout installed like its wheel into a folder of its own (pip --target): `script` is
    the `xpyd` console script pip wrote from pyproject's [project.scripts], `site` its packages.
    (The shared .venv's editable install belongs to another checkout, so its script is not ours.)"""
    script: Path
    site: Path

    def command(self, *sub: str) -> tuple[str, ...]:
        return (str(self.script), *sub)

    def env(self) -> dict[str, str]:
        """Imports resolve to the installed copy first, as they would after `pip install xpyd`."""
        return {"PYTHONPATH": str(self.site)}


def install_xpyd(dest: Path) -> InstalledXpyd:
    src = dest / "src"
    src.mkdir(parents=True)
    # A copy of what the build reads: setuptools' build/ folder in the checkout may hold an earlier build.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-build-isolation", "--no-index", "--target", str(dest / "site"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    script = dest / "site" / "bin" / "xpyd"
    assert script.is_file(), f"pip wrote no xpyd console script: {sorted(p.name for p in (dest / 'site').iterdir())}"
    return InstalledXpyd(script, dest / "site")


def free_port_offset(topo: Topology, start: int = 1000, step: int = 97, tries: int = 60) -> int:
    """A port offset at which every port of the layout is free now (other agents and tests
    share this machine)."""
    for k in range(tries):
        off = start + k * step
        t = topo.with_port_offset(off)
        by_host: dict[str, list[int]] = {}
        for p in t.proxies:
            by_host.setdefault(p.host, []).extend([p.port, p.discovery_port])
        for i in t.instances:
            by_host.setdefault(i.host, []).extend([i.port, *i.kv_ports, *i.events_ports])
        if all(port_free(h, p) for h, ps in by_host.items() for p in ps):
            return off
    raise RuntimeError("no free port offset")


def proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, pgid, start time) for every process we can see."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2:].split()  # fields after "(comm)"
        out[int(d)] = (int(rest[1]), int(rest[2]), rest[19])
    return out


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of root's descendants (children, grandchildren, ...)."""
    table = proc_table()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out[k] = table[k][2]
            todo.append(k)
    return out


def still_running(procs: dict[int, str]) -> list[int]:
    """Those of procs (pid -> start time) that exist now (same pid and start time)."""
    table = proc_table()
    return [pid for pid, st in procs.items() if pid in table and table[pid][2] == st
            and Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0]


def in_groups(pgids: set[int]) -> list[int]:
    """Live (non-zombie) processes in these process groups: the launcher starts each server
    as a group leader, and vLLM's engine and worker processes stay in that group."""
    out = []
    for pid, (_, pgid, _) in proc_table().items():
        if pgid in pgids:
            try:
                if "State:\tZ" not in Path(f"/proc/{pid}/status").read_text():
                    out.append(pid)
            except OSError:
                pass
    return out


@dataclass
class LauncherRun:
    args: list[str]
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @classmethod
    def start(cls, args: list[str], command: tuple[str, ...] = LAUNCH_MODULE,
              extra_env: dict[str, str] | None = None) -> LauncherRun:
        """`command args` from the checkout's root (`xpyd launch` or `python -m xpyd_deploy.launch`)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        proc = subprocess.Popen([*command, *args], cwd=ROOT, env=env,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        run = cls(args, proc)
        run._reader = threading.Thread(target=run._read, daemon=True)
        run._reader.start()
        return run

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def started_pids(self) -> set[int]:
        """PIDs (= process groups) of the servers the launcher reported starting."""
        return {int(m.group(1)) for line in self.lines if (m := re.search(r"started \S+ \(\S+\) pid (\d+)", line))}

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first output line matching pattern; fails if the launcher exits first."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                m = rx.search(line)
                if m:
                    return m
                seen += 1
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"launcher exited (rc={self.proc.returncode}) before {pattern!r}:\n"
                                     f"{self.output()[-6000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} after {timeout}s:\n{self.output()[-6000:]}")

    def wait_exit(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running {timeout}s later:\n{self.output()[-4000:]}") from None
        if self._reader is not None:
            self._reader.join(timeout=5)
        return rc

    def kill(self) -> None:
        """Test clean-up after a failure: the launcher and everything below it, by PID."""
        kids = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in still_running(kids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


DASHBOARD = ROOT / "configs" / "grafana" / "xpyd-dashboard.json"


def dashboard_metrics() -> set[str]:
    """Metric names the Grafana dashboard's queries use."""
    import json

    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\b(xpyd_[a-z_]+|vllm:[a-z_:]+)", e)}


def exposed_metrics(text: str) -> set[str]:
    """Sample names a Prometheus /metrics page has, or will have once a labelled series is
    observed (from its # TYPE lines: counter -> _total, histogram -> _bucket/_sum/_count)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "counter":
                names |= {name + "_total", name.removesuffix("_total") + "_total"}
            elif kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
