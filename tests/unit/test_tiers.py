"""The suite's own rules (tests/conftest.py, pyproject.toml's pytest options), run on small
inner test files in a fresh pytest process with this repo's conftest and pytest settings:
the `unit` tier marker, per-test time limits that fail a hang with its stack and let the run
go on, and a missing external tool that skips locally but fails where CI=true."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    shutil.copy(ROOT / "tests" / "conftest.py", pytester.path / "conftest.py")
    shutil.copy(ROOT / "pyproject.toml", pytester.path / "pyproject.toml")
    monkeypatch.delenv("CI", raising=False)
    return pytester


def _run(p: pytest.Pytester, *args: str) -> pytest.RunResult:
    return p.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *args, timeout=240)


def test_unit_marker_selects_the_tests_that_need_no_server_tool_or_gpu(inner):
    inner.makepyfile(test_t="""
        import pytest
        def test_plain(): pass
        @pytest.mark.vllm
        def test_server(): pass
        @pytest.mark.docker
        def test_compose(): pass
        @pytest.mark.tool("xpyd-no-such-tool")
        def test_binary(): pass
        @pytest.mark.gpu
        def test_cuda(): pass
        @pytest.mark.nccl
        def test_real_libnccl(): pass
    """)
    unit = _run(inner, "-m", "unit", "test_t.py")
    unit.assert_outcomes(passed=1, deselected=5)
    unit.stdout.fnmatch_lines(["PASSED test_t.py::test_plain"])
    rest = _run(inner, "-m", "not unit", "test_t.py")
    assert rest.parseoutcomes()["deselected"] == 1
    assert "test_plain" not in rest.stdout.str()


def test_a_hang_fails_with_its_stack_and_the_run_goes_on(inner):
    inner.makepyfile(test_t="""
        import asyncio, subprocess, time
        import pytest

        @pytest.mark.timeout(2)
        def test_sleeps():
            time.sleep(60)

        @pytest.mark.timeout(2)
        async def test_awaits():
            await asyncio.sleep(60)

        @pytest.mark.timeout(2)
        def test_waits_for_a_child():
            subprocess.run(["sleep", "60"])

        def test_after(): pass
    """)
    r = _run(inner, "test_t.py")
    r.assert_outcomes(failed=3, passed=1)
    out = r.stdout.str()
    assert out.count("Failed: Timeout (>2.0s) from pytest-timeout") >= 3, out
    assert "time.sleep(60)" in out and "subprocess.run" in out  # the stacks name where each hung
    assert r.duration < 60


def test_tests_that_start_servers_get_the_longer_limit(inner):
    inner.makepyfile(test_t="""
        import pytest
        def test_plain(request):
            assert request.node.get_closest_marker("timeout") is None
            assert request.config.getini("timeout") == "300"
        @pytest.mark.vllm
        def test_server(request):
            assert request.node.get_closest_marker("timeout").args == (1200,)
        @pytest.mark.vllm
        @pytest.mark.timeout(7)
        def test_own(request):
            assert request.node.get_closest_marker("timeout").args == (7,)
    """)
    _run(inner, "test_t.py").assert_outcomes(passed=3)


TOOL_TESTS = """
    import pytest
    @pytest.mark.tool("xpyd-no-such-tool")
    def test_marked(): pass
    @pytest.mark.skipif(True, reason="haproxy is not installed (scripts/setup_system.sh installs it)")
    def test_spelled_as_skipif(): pass
    @pytest.mark.tool("sh")
    def test_present(): pass
"""


def test_a_missing_tool_skips_locally_saying_so(inner):
    inner.makepyfile(test_t=TOOL_TESTS)
    r = _run(inner, "test_t.py")
    r.assert_outcomes(skipped=2, passed=1)
    r.stdout.fnmatch_lines(["*skipped: what this machine lacks*",
                            "SKIPPED 1 test: xpyd-no-such-tool is not installed*",
                            "SKIPPED 1 test: haproxy is not installed*"])


def test_a_missing_tool_fails_in_ci(inner, monkeypatch):
    inner.makepyfile(test_t=TOOL_TESTS)
    monkeypatch.setenv("CI", "true")
    r = _run(inner, "test_t.py")
    assert r.ret == 1
    outcomes = r.parseoutcomes()
    assert outcomes.get("passed") == 1 and not outcomes.get("skipped"), outcomes
    assert outcomes.get("failed", 0) + outcomes.get("errors", 0) == 2, outcomes
    out = r.stdout.str()
    assert "CI=true and xpyd-no-such-tool is not installed" in out
    assert "CI=true and haproxy is missing" in out
