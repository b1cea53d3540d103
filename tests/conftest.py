"""Shared fixtures and the tiers' rules. The tests' shared code is the tests.support package
(tests/support/), imported from the repository root (pyproject's pythonpath)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
from collections import Counter

import pytest

# A GPU machine with torch alone (no vLLM, none of the proxy's web stack) runs
# `pytest -m gpu tests/`. There a module that needs a package not installed is skipped with
# the reason instead of failing the collection. Where vLLM is installed (CI) nothing changes:
# a missing package is an error, as it should be.
_MISSING_IMPORT = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
_OWN_PACKAGES = {"proxy", "connector", "xpyd_wire", "xpyd_deploy", "tests", "scripts"}

# Tiers. A test with none of these markers needs no vLLM server, no external binary (NVIDIA's
# libnccl included) and no GPU: it gets the `unit` marker, so `pytest -m unit` is the fast tier
# and `-m "not unit"` the rest.
NOT_UNIT = ("vllm", "docker", "tool", "gpu", "nccl", "vllm033")
# Per-test time limits (pytest-timeout; the default, 300 s, is in pyproject.toml). pytest-timeout
# counts fixture set-up in the test's time, so the first test of a module that starts vLLM
# servers in a module fixture (several minutes on a loaded 2-core box) carries their start-up.
SERVER_TIMEOUT_S = 1200  # tests marked vllm or docker
SLOW_SETUP_TIMEOUT_S = {  # unit modules whose module fixture may take long on a fresh machine
    "test_nccl_real_lib.py": 1200,  # fetches 1.7 GB of NCCL wheels once (scripts/nccl_wheels.py)
    "test_doctor.py": 900,  # the doctor's no-GPU run: ~105 s idle, over 300 s at load 12-15 (engine pairs ~63 s each)
    "test_vllm033.py": 3000,  # vLLM 0.33's GPU wheel, ~340 MB, fetched once (scripts/check_vllm033.sh)
}
# External binaries that CI is meant to have (scripts/setup_system.sh installs them from Debian's
# packages). Where CI=true a test that finds one missing fails instead of skipping.
CI_TOOLS = ("haproxy", "prometheus", "kubectl")
_MISSING_TOOL = re.compile(rf"\b({'|'.join(CI_TOOLS)}) is not installed")
_TOOL_DIRS = ("/usr/sbin", "/usr/local/sbin", "/usr/bin", "/usr/local/bin")  # Debian's sbin is not on every PATH


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def find_tool(name: str) -> str | None:
    """Where the tests' own look-ups find ``name``: the PATH, then Debian's bin and sbin folders."""
    return shutil.which(name) or next((p for d in _TOOL_DIRS if os.access(p := f"{d}/{name}", os.X_OK)), None)


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny model's tokenizer (end-to-end tests)."""
    from tests.support.e2e_client import load_tokenizer

    return load_tokenizer()


@pytest.fixture
def kv_client():
    """A plain KV transport for calling an engine's control socket as a peer would (op abort,
    ready, a GET's fetch); closed afterwards. Shared by the connector's engine tests."""
    from connector.transport.tcp import TcpTransport

    cli = TcpTransport()
    yield cli
    cli.close()


@pytest.fixture
def engines():
    """start(role, send_type, ...) -> a real KVEngine on a free loopback port, its transport
    built from the config as the worker builds it (caps, kv_secret); all closed afterwards.
    Shared by the engine, KV-auth and KV-fuzz tests."""
    from connector import layout as kvlayout
    from connector.p2p.engine import KVEngine
    from connector.transport import TransportError
    from tests.support.kv_engines import free_port, make_caches, make_cfg

    started: list[KVEngine] = []

    def start(role: str, send_type: str = "PUT_ASYNC", caches=None, layout=None, rank: int = 0,
              seed: int = 0, transport=None, tp_side=None, **over) -> KVEngine:
        """``transport(cfg)``, when given, builds the engine's transport instead of its config."""
        caches = caches if caches is not None else make_caches(seed)
        layout = layout or kvlayout.detect(None, caches)
        for _ in range(5):  # a free port can be taken by someone else before we bind it
            cfg = make_cfg(role, send_type, free_port() - rank, **over)
            try:
                eng = KVEngine(cfg, rank, caches, layout, transport=transport(cfg) if transport else None,
                               tp_side=tp_side)
            except TransportError:
                continue
            eng.caches, eng.cfg, eng.block_layout = caches, cfg, layout  # for assertions
            started.append(eng)
            return eng
        raise RuntimeError("no free port")

    yield start
    for eng in started:
        eng.close()


def pytest_configure(config: pytest.Config) -> None:
    """`timeout`, CI runners and helpers stop a run with SIGTERM, which would end pytest
    without tearing fixtures down and leave their vLLM servers running. As a
    KeyboardInterrupt it still runs every finalizer (the clusters stop their servers)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if report.failed and isinstance(collector, pytest.Module):
        missing = _MISSING_IMPORT.search(str(report.longrepr))
        name = missing.group(1) if missing else ""
        ours = name.split(".")[0] in _OWN_PACKAGES  # our own module missing is a packaging bug
        if name and not ours and importlib.util.find_spec("vllm") is None and not _importable(name):
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: needs {name}, not installed here")
    return report


def _importable(name: str) -> bool:
    """Whether the dotted module `name` can be found. The whole name, not its top package: a
    machine may have a namespace package's top (`opentelemetry` from the API) and lack the
    distribution that adds `opentelemetry.proto`."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: `-m unit` must see the marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `unit` marker and the per-tier time limits (see NOT_UNIT); tests marked `gpu` skip
    themselves on machines without CUDA (CI has none)."""
    for item in items:
        own = {m.name for m in item.iter_markers()}
        if not own & set(NOT_UNIT):
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("timeout") is None:
            limit = SLOW_SETUP_TIMEOUT_S.get(item.path.name)
            if own & {"vllm", "docker"}:
                limit = max(limit or 0, SERVER_TIMEOUT_S)
            if limit:
                item.add_marker(pytest.mark.timeout(limit))

    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.tool("haproxy")`: the test runs an external binary; without it the test
    skips, saying so, and fails where CI=true (CI is meant to have every tool a test names)."""
    for marker in item.iter_markers("tool"):
        name = marker.args[0]
        if find_tool(name) is None:
            reason = f"{name} is not installed (scripts/setup_system.sh installs it from Debian's packages)"
            if in_ci():
                pytest.fail(f"CI=true and {reason}: CI is meant to have it (see setup_system's output)",
                            pytrace=False)
            pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Where CI=true, a test skipped because a tool CI is meant to have is missing is a failure,
    however its module spells the skip (a reason "<tool> is not installed", as
    tests/support/haproxy_helpers.py's SKIP_REASON that the multinode module's skipif uses)."""
    report = yield
    if report.skipped and in_ci() and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        missing = _MISSING_TOOL.search(reason)
        if missing and not hasattr(report, "wasxfail"):
            report.outcome = "failed"
            report.longrepr = (f"CI=true and {missing.group(1)} is missing: CI is meant to have it "
                               f"(scripts/setup_system.sh installs it; see its output). {reason}")
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """One line per missing tool or machine feature that skipped tests, so a run that skipped
    a part of the suite says so at its end (`-rs` lists each)."""
    reasons: Counter[str] = Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        if isinstance(rep.longrepr, tuple) and not hasattr(rep, "wasxfail"):
            reasons[str(rep.longrepr[2]).removeprefix("Skipped: ")] += 1
    if not reasons:
        return
    terminalreporter.write_sep("=", "skipped: what this machine lacks")
    for reason, n in reasons.most_common():
        terminalreporter.write_line(f"SKIPPED {n} test{'s' if n != 1 else ''}: {reason}")
