"""haproxy for the e2e tests: found where Debian installs it, run in the foreground in its
own session and stopped by its PID, its log and its Prometheus page read back."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from datetime import datetime
from pathlib import Path

import httpx

from xpyd_deploy.haproxy_cfg import BACKEND  # noqa: E402  (xpyd_deploy/haproxy_cfg.py)
from tests.support.e2e_client import poll
from tests.support.ports import free_port as any_free_port  # noqa: F401  (the tests' name for it)


def _find_haproxy() -> str | None:
    found = shutil.which("haproxy")  # Debian installs it in /usr/sbin, not on every PATH
    return found or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
                         None)


HAPROXY = _find_haproxy()
# "<tool> is not installed": where CI=true tests/conftest.py turns this skip into a failure.
SKIP_REASON = "haproxy is not installed (scripts/setup_system.sh installs it: apt-get install haproxy)"


LOG_LINE = re.compile(r"\[(?P<date>[^\]]+)\] \S+ \S+/(?P<server>\S+) -?\d+/-?\d+/-?\d+/-?\d+/(?P<ta>\d+) "
                      r"(?P<status>\d+) .* \d+/\d+/\d+/\d+/(?P<retries>\+?\d+) \d+/\d+ \"POST ", re.M)


class Balancer:
    """haproxy in the foreground, in its own session, stopped by its PID."""

    def __init__(self, cfg: Path, log_dir: Path, url: str, stats_url: str | None = None) -> None:
        assert HAPROXY is not None, SKIP_REASON
        check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = log_dir / "haproxy.log"
        self.url, self.stats_url = url, stats_url
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([HAPROXY, "-f", str(cfg), "-db", "-p", str(log_dir / "haproxy.pid")],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def state(self, server: str) -> str | None:
        """haproxy's view of one proxy: UP, DOWN, ... (its Prometheus exporter)."""
        try:
            raw = httpx.get(self.stats_url + "/metrics", timeout=2).text
        except httpx.HTTPError:
            return None
        m = re.search(rf'^haproxy_server_status{{proxy="{BACKEND}",server="{server}",state="(\w+)"}} 1$', raw, re.M)
        return m.group(1) if m else None

    def wait_state(self, server: str, want: str, timeout: float) -> None:
        assert poll(lambda: self.proc.poll() is None and self.state(server) == want, timeout, 0.1), (
            server, self.state(server), self.proc.poll(), self.log.read_text()[-3000:])

    def requests(self) -> list[tuple[str, int, float, bool]]:
        """(proxy, status, end as a wall-clock time, redispatched) per request in haproxy's log
        (option httplog: "[accept date] frontend backend/server TR/Tw/Tc/Tr/Ta status ...
        actconn/feconn/beconn/srv_conn/retries" where retries reads "+N" after a redispatch)."""
        out = []
        for m in LOG_LINE.finditer(self.log.read_text()):
            accept = datetime.strptime(m["date"], "%d/%b/%Y:%H:%M:%S.%f").timestamp()
            out.append((m["server"], int(m["status"]), accept + int(m["ta"]) / 1000, m["retries"].startswith("+")))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
