"""Shared fixtures. The tests' helper modules (e2e_cluster, e2e_client,
proxy_helpers, fake_vllm) live beside the tests and import as top-level modules."""

from __future__ import annotations

import importlib.util
import re
import signal

import pytest

# A GPU machine with torch alone (no vLLM, none of the proxy's web stack) runs
# `pytest -m gpu tests/`. There a module that needs a package not installed is skipped with
# the reason instead of failing the collection. Where vLLM is installed (CI) nothing changes:
# a missing package is an error, as it should be.
_MISSING_IMPORT = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny model's tokenizer (end-to-end tests)."""
    from e2e_client import load_tokenizer

    return load_tokenizer()


@pytest.fixture
def engines():
    """start(role, send_type, ...) -> a real KVEngine on a free loopback port, its transport
    built from the config as the worker builds it (caps, kv_secret); all closed afterwards.
    Shared by the engine, KV-auth and KV-fuzz tests."""
    from test_connector_engine import free_port, make_caches, make_cfg

    from connector import layout as kvlayout
    from connector.engine import KVEngine
    from connector.transport import TransportError

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
        top = missing.group(1).split(".")[0] if missing else ""
        if top and importlib.util.find_spec("vllm") is None and importlib.util.find_spec(top) is None:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: needs {top}, not installed here")
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip themselves on machines without CUDA (CI has none)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
