"""Run an xPyD topology from configs/topologies/ on this machine: start its proxies and vLLM
instances, watch them, stop them (`xpyd launch ...` = `python -m xpyd_deploy.launch ...`).

    xpyd launch up 1p2d                        # proxy + 1 P + 2 D, until Ctrl-C / SIGTERM
    xpyd launch up 1p1d --once                 # answer one request through the proxy, then stop
    xpyd launch up multinode --only prefill-0  # this host's share of a multi-host layout
    xpyd launch commands 1p2d                  # print every process's command line
    xpyd launch list                           # the named topologies

Every process runs in its own session with its output in <log-dir>/<name>.log. SIGINT
(Ctrl-C) and SIGTERM only set a flag: whatever the launcher is doing (starting, waiting
for health, serving) it then stops every process group it started, by PID (SIGTERM,
then SIGKILL after a grace period) and exits. Nothing it did not start is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from xpyd_deploy.topology import (
    ROOT,
    TOPOLOGY_DIR,
    InstanceSpec,
    ProxySpec,
    Topology,
    TopologyError,
    all_topologies,
    load_topology,
)

LOG_TAIL_LINES = 40
# The CPU build's legacy KV-size variable overrides --kv-cache-memory-bytes: never inherit it.
DROPPED_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
# Secrets never go on a command line (any local user reads /proc/<pid>/cmdline, and vLLM prints
# its --kv-transfer-config at start-up) nor into a topology file: every process inherits them
# from the launcher's environment, as XPYD_<NAME> or XPYD_<NAME>_FILE (a file holding it).
SECRET_FLAGS = ("--discovery-secret", "--api-key", "--upstream-api-key")
SECRET_KV_KEYS = ("discovery_secret", "kv_secret")
SECRET_ENV = ("XPYD_DISCOVERY_SECRET", "XPYD_KV_SECRET", "XPYD_API_KEY", "XPYD_UPSTREAM_API_KEY")


def secrets_in_topology(topo: Topology) -> list[str]:
    """Where the topology would put a secret on a command line or in its own file."""
    out = []
    for p in topo.proxies:
        for flag in (a.split("=", 1)[0] for a in p.args):
            if flag in SECRET_FLAGS:
                env = "XPYD_" + flag.removeprefix("--").replace("-", "_").upper()
                out.append(f"proxy {p.name}: {flag} in its args: export {env} (or {env}_FILE) instead")
    for i in topo.instances:
        extra = {**topo.kv_transfer, **i.kv_transfer}
        for key in SECRET_KV_KEYS:
            if extra.get(key) is not None:
                env = "XPYD_" + key.upper()
                out.append(f"{i.name}: {key} in its kv_transfer: export {env} (or {env}_FILE), "
                           f"or set {key}_file to a file holding it")
        for key in {**topo.env, **i.env}:
            if key in SECRET_ENV:
                out.append(f"{i.name}: {key} written in the topology: export it in the launcher's environment")
    return out


class LaunchError(RuntimeError):
    """A process that failed to start, or a deadline that passed; the message says which."""


class Stopped(Exception):
    """SIGINT/SIGTERM arrived while starting."""


@dataclass
class Proc:
    name: str
    kind: str  # "proxy" | "P" | "D"
    url: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen | None = None
    ready: bool = False
    exit_reported: bool = False

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def group_alive(self) -> bool:
        """Any process left in the group we started (vLLM's engine and worker children too)."""
        if self.popen is None:
            return False
        self.popen.poll()  # reap the leader if it exited
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class LaunchOptions:
    log_dir: Path
    timeout: float = 600.0  # seconds for every instance to answer /health and register
    proxy_timeout: float = 60.0
    stop_grace: float = 30.0  # SIGTERM -> SIGKILL
    once: bool = False  # answer one request through the proxy, then stop
    python: str = sys.executable
    progress_every: float = 10.0
    names: Sequence[str] | None = None  # start only these (one host's share of a layout)
    out: TextIO = field(default_factory=lambda: sys.stdout)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (addresses from the topology)
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _ok(url: str) -> bool:
    try:
        return http_get(url, timeout=1.0)[0] == 200
    except OSError:
        return False


def registered(proxy: ProxySpec, insts: Sequence[InstanceSpec]) -> set[str]:
    """Names of insts the proxy lists in /instances as candidates (not pending: a newly
    registered instance is routed to only once it has answered the proxy's probe)."""
    try:
        status, body = http_get(proxy.url + "/instances", timeout=1.0)
        entries = [e for e in (json.loads(body) if status == 200 else []) if not e.get("pending")]
        if all("http_address" in e for e in entries):  # --expose-routing-headers: by address
            listed = {(e["role"], e["http_address"]) for e in entries}
            return {i.name for i in insts if (i.role, f"{i.host}:{i.port}") in listed}
        roles = [e["role"] for e in entries]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    # By default /instances names no address: a role counts as registered once the proxy
    # lists as many instances of it as were started here.
    return {i.name for i in insts if roles.count(i.role) >= sum(j.role == i.role for j in insts)}


class Launcher:
    def __init__(self, topo: Topology, opts: LaunchOptions) -> None:
        self.topo = topo
        self.opts = opts
        if opts.names:
            self.proxies, self.instances = topo.select(opts.names)
        else:
            self.proxies, self.instances = list(topo.proxies), list(topo.instances)
        self.procs: list[Proc] = []
        self.stop_requested = threading.Event()
        self._signals = 0
        self._t0 = time.monotonic()

    # ---- output ------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        print(f"[launch {time.monotonic() - self._t0:6.1f}s] {msg}", file=self.opts.out, flush=True)

    # ---- signals -----------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        self.stop_requested.set()
        if self._signals > 1:  # asked twice: do not wait for graceful shutdowns
            for p in self.procs:
                p.signal_group(signal.SIGKILL)

    def install_signal_handlers(self) -> Callable[[], None]:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(s, h) for s, h in old.items()]  # type: ignore[func-returns-value]

    # ---- processes ---------------------------------------------------------------------
    def _spawn(self, name: str, kind: str, url: str, cmd: list[str], extra_env: dict[str, str]) -> Proc:
        if self.stop_requested.is_set():
            raise Stopped
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        # The connector must import in vLLM's API server, EngineCore and worker processes.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.update(extra_env)
        self.opts.log_dir.mkdir(parents=True, exist_ok=True)
        proc = Proc(name, kind, url, cmd, env, self.opts.log_dir / f"{name}.log")
        with open(proc.log_path, "wb") as logf:
            # Own session: a terminal's Ctrl-C reaches only us, and we stop the whole group.
            proc.popen = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=ROOT, start_new_session=True)
        self.procs.append(proc)
        self.say(f"started {name} ({kind}) pid {proc.pid} -> {url}  log {proc.log_path}")
        return proc

    def start_proxies(self) -> list[Proc]:
        return [self._spawn(p.name, "proxy", p.url, self.topo.proxy_command(p, self.opts.python), {})
                for p in self.proxies]

    def start_instances(self) -> list[Proc]:
        out = []
        for i in self.instances:
            dev = f" devices {list(i.devices)}" if i.devices else ""
            self.say(f"{i.name}: {i.role} tp={i.tp}{dev} kv {i.host}:{i.kv_port}")
            out.append(self._spawn(i.name, i.role, i.url, self.topo.vllm_command(i, self.opts.python),
                                   self.topo.vllm_env(i)))
        return out

    def _check_exits(self, procs: Sequence[Proc]) -> None:
        for p in procs:
            if not p.alive():
                rc = p.popen.returncode if p.popen else None
                raise LaunchError(f"{p.name} exited during start-up (rc={rc}); last lines of {p.log_path}:\n"
                                  f"{p.log_tail()}")

    def wait_healthy(self, procs: Sequence[Proc], timeout: float) -> None:
        """Poll /health of every proc until 200, with a deadline and a progress line."""
        deadline = time.monotonic() + timeout
        next_progress = time.monotonic() + self.opts.progress_every
        while True:
            if self.stop_requested.is_set():
                raise Stopped
            self._check_exits(procs)
            for p in procs:
                if not p.ready and _ok(p.url + "/health"):
                    p.ready = True
                    self.say(f"{p.name} healthy")
            pending = [p.name for p in procs if not p.ready]
            if not pending:
                return
            now = time.monotonic()
            if now > deadline:
                tails = "\n".join(f"--- {p.name} ({p.log_path}) ---\n{p.log_tail(15)}" for p in procs if not p.ready)
                raise LaunchError(f"not healthy after {timeout:.0f}s: {pending}\n{tails}")
            if now >= next_progress:
                self.say(f"waiting for {', '.join(pending)} ({deadline - now:.0f}s left)")
                next_progress = now + self.opts.progress_every
            self.stop_requested.wait(0.5)

    def wait_registered(self, timeout: float) -> None:
        """Every proxy of the topology lists every instance started here (P and D announce
        themselves over discovery once their /health answers)."""
        if not self.instances:
            return
        deadline = time.monotonic() + timeout
        while True:
            if self.stop_requested.is_set():
                raise Stopped
            self._check_exits(self.procs)
            missing = {p.name: sorted({i.name for i in self.instances} - registered(p, self.instances))
                       for p in self.topo.proxies}
            missing = {k: v for k, v in missing.items() if v}
            if not missing:
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"instances not registered after {timeout:.0f}s: {missing}")
            self.stop_requested.wait(0.5)

    def stop_all(self) -> None:
        """SIGTERM every group we started at once, SIGKILL what is left after the grace period."""
        live = [p for p in self.procs if p.group_alive()]
        if not live:
            return
        self.say(f"stopping {', '.join(p.name for p in live)} (pids {', '.join(str(p.pid) for p in live)})")
        for p in live:
            p.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.opts.stop_grace
        while time.monotonic() < deadline and any(p.group_alive() for p in live):
            time.sleep(0.2)
        for p in live:
            if p.group_alive():
                self.say(f"{p.name} still running after {self.opts.stop_grace:.0f}s: SIGKILL")
                p.signal_group(signal.SIGKILL)
        for p in live:
            if p.popen is not None:
                try:
                    p.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.say(f"{p.name} (pid {p.pid}) did not exit after SIGKILL")
        self.say("stopped")

    # ---- the whole run -----------------------------------------------------------------
    def smoke_request(self) -> bool:
        """One greedy completion through the first proxy, printed (what the README's curl does)."""
        proxy = self.topo.proxies[0]
        self.say(f"sending one completion through {proxy.name}")
        body = {"model": self.topo.served_model_name, "prompt": "The quick brown fox", "max_tokens": 8,
                "temperature": 0}
        req = urllib.request.Request(proxy.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310
                text = r.read().decode()
        except (OSError, urllib.error.HTTPError) as e:
            self.say(f"request through {proxy.name} failed: {e}")
            return False
        print(text, file=self.opts.out, flush=True)
        return '"choices"' in text

    def serve(self) -> None:
        """Until a signal: report (once each) processes that exit on their own."""
        while not self.stop_requested.wait(1.0):
            for p in self.procs:
                if not p.alive() and not p.exit_reported:
                    p.exit_reported = True
                    self.say(f"{p.name} exited (rc={p.popen.returncode if p.popen else None}); "
                             f"last lines of {p.log_path}:\n{p.log_tail()}")

    def run(self) -> int:
        restore = self.install_signal_handlers()
        try:
            model = self.topo.model
            if self.instances and model.startswith((".", "/")) and not Path(self.topo.model_path()).exists():
                raise LaunchError(f"model {model} not found (the tiny CPU model is made by scripts/setup.sh)")
            what = ", ".join([f"{p.name} :{p.port}" for p in self.proxies] +
                             [f"{i.name} ({i.role}) :{i.port}" for i in self.instances])
            self.say(f"topology {self.topo.name} ({self.topo.shape}, {self.topo.device}): starting {what}; "
                     f"logs in {self.opts.log_dir}")
            proxies = self.start_proxies()
            self.wait_healthy(proxies, self.opts.proxy_timeout)
            instances = self.start_instances()
            self.wait_healthy(instances, self.opts.timeout)
            self.wait_registered(60.0)
            for p in self.proxies:
                self.say(f"ready: {p.url}  (/v1/completions, /v1/chat/completions, /instances, /metrics)")
            if self.topo.proxies and self.instances:
                url = self.topo.proxies[0].url
                self.say(f"try: curl -s {url}/v1/completions -H 'Content-Type: application/json' -d "
                         f"'{{\"model\": \"{self.topo.served_model_name}\", \"prompt\": \"The quick brown fox\", "
                         f"\"max_tokens\": 8, \"temperature\": 0}}'")
            # Only the whole layout can answer; one host's share of it (--only) may wait for others.
            if not self.opts.names and not self.smoke_request():
                raise LaunchError("the first request through the proxy failed (see the instance logs)")
            if self.opts.once:
                return 0
            self.say("running; Ctrl-C or SIGTERM stops everything")
            self.serve()
            return 0
        except Stopped:
            self.say("signal received during start-up")
            return 0
        except LaunchError as e:
            self.say(f"FAILED: {e}")
            return 1
        finally:
            self.stop_all()
            restore()


def _topology(args: argparse.Namespace):
    topo = load_topology(args.topology)
    return topo.with_port_offset(args.port_offset) if args.port_offset else topo


def main(argv: list[str] | None = None, prog: str = "python -m xpyd_deploy.launch") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("up", "start the topology and keep it running"),
                        ("commands", "print the command line and env of every process")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("topology", help="a file, or a name under configs/topologies/ (1p1d, 1p2d, ...)")
        p.add_argument("--port-offset", type=int, default=0, help="shift every port (a second copy on one host)")
        p.add_argument("--only", default=None, help="comma-separated proxy/instance names to start here")
    up = sub.choices["up"]
    up.add_argument("--log-dir", default=None, help="one log per process (default .logs/<topology>)")
    up.add_argument("--timeout", type=float, default=600, help="seconds for all instances to become healthy")
    up.add_argument("--stop-grace", type=float, default=30, help="seconds between SIGTERM and SIGKILL")
    up.add_argument("--once", action="store_true", help="send one completion through the proxy, then stop")
    up.add_argument("--python", default=sys.executable, help="interpreter that runs vLLM and the proxy")
    sub.add_parser("list", help="the topologies under configs/topologies/")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            topos = all_topologies()
            for t in topos:
                print(f"{t.name:10s} {t.shape:5s} {t.device:4s} {t.description}")
            if not topos:  # an installed wheel run outside a checkout: names resolve under ./configs/topologies
                print(f"no topologies under {TOPOLOGY_DIR} (give `up` a file instead)", file=sys.stderr)
            return 0
        topo = _topology(args)
        leaks = secrets_in_topology(topo)
        if leaks:
            raise TopologyError("secrets belong in the environment, not in argv or the topology:\n  "
                                + "\n  ".join(leaks))
        names = [n for n in (args.only or "").split(",") if n]
        if args.cmd == "commands":
            proxies, insts = topo.select(names) if names else (topo.proxies, topo.instances)
            for p in proxies:
                print(f"# {p.name}\n{shlex.join(topo.proxy_command(p, 'python'))}")
            for i in insts:
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in topo.vllm_env(i).items())
                print(f"# {i.name} ({i.role})\n{env + ' ' if env else ''}{shlex.join(topo.vllm_command(i, 'python'))}")
            return 0
        log_dir = Path(args.log_dir) if args.log_dir else ROOT / ".logs" / topo.name
        opts = LaunchOptions(log_dir=log_dir, timeout=args.timeout, stop_grace=args.stop_grace, once=args.once,
                             python=args.python, names=names or None)
        return Launcher(topo, opts).run()
    except TopologyError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
