"""``xpyd doctor`` (connector/tools/doctor.py) as CI runs it: no GPU, a real libnccl (the newest
wheel's, from .nccl-wheels/, fetched by scripts/nccl_wheels.py). It must run every
device-free check, pass them, list what it could not check, and exit 3, not 0 and not 1."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from connector.tools import doctor
from xpyd_deploy import cli as xpyd_cli

REPO = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("nccl_wheels", REPO / "scripts" / "nccl_wheels.py")
nccl_wheels = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(nccl_wheels)


@pytest.fixture(scope="module")
def newest_libnccl() -> Path:
    dist, version, _ = nccl_wheels.WHEELS[-1]
    try:
        with nccl_wheels._locked():
            row = nccl_wheels.fetch_one(dist, version)
    except Exception as e:  # noqa: BLE001 - no NCCL to check against fails the test, loudly
        pytest.fail(f"could not fetch {dist}=={version} (needs PyPI): {e}", pytrace=False)
    return Path(row["path"]) / "libnccl.so.2"


@pytest.mark.nccl  # NVIDIA's libnccl (and the doctor imports vLLM): the rest tier
@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU run; a GPU machine runs the full doctor")
def test_doctor_without_a_gpu_runs_the_device_free_checks_and_exits_3(newest_libnccl, tmp_path):
    out = tmp_path / "doctor.json"
    r = subprocess.run([sys.executable, "-m", "connector.tools.doctor", "--quiet", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO), "XPYD_NCCL_LIBRARY": str(newest_libnccl)})
    assert r.returncode == doctor.EXIT_NO_GPU == 3, r.stdout[-4000:] + r.stderr[-4000:]
    assert "no GPU here" in r.stdout and "not checked here" in r.stdout
    report = json.loads(out.read_text())
    assert report["exit_code"] == 3 and report["gpu"] is False
    status = {c["name"]: c["status"] for c in report["checks"]}
    for name in ("nccl.library", "nccl.unique_id", "nccl.config_struct", "nccl.init_without_gpu",
                 "transport.tcp_roundtrip", "layout.cpu_gather_scatter"):
        assert status[name] == "pass", (name, report["checks"])
    pairs = [n for n in status if n.startswith("engine.cpu_tcp[")]
    # PUT_ASYNC, PUT, GET, and PUT_ASYNC with layer-wise sends
    assert len(pairs) == 4 and all(status[n] == "pass" for n in pairs)
    assert not any(s == "fail" for s in status.values())
    assert not any(n.startswith(("engine.gpu", "bench.")) for n in status)  # nothing pretends to be GPU
    lib = next(c for c in report["checks"] if c["name"] == "nccl.library")
    assert lib["data"]["version"] == nccl_wheels.WHEELS[-1][1]
    assert "include/nccl.h" in next(c for c in report["checks"] if c["name"] == "nccl.config_struct")["detail"]
    assert any("needs a GPU" in x for x in report["not_checked"])
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["cuda_available"] is False
    assert set(env["layouts_supported"]) == {"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"}


def test_exit_codes_are_the_documented_ones():
    report = doctor.Report(verbose=False)
    report.run("a", lambda: ("pass", "", None))
    report.run("b", lambda: ("info", "", None))
    assert report.exit_code(gpu=True) == 0 and report.exit_code(gpu=False) == 3
    report.run("c", lambda: (_ for _ in ()).throw(RuntimeError("boom")))  # a check that raises fails
    assert report.checks[-1].status == "fail" and "boom" in report.checks[-1].detail
    assert report.exit_code(gpu=True) == report.exit_code(gpu=False) == 1
    assert doctor.__doc__.count("3 no GPU") == 1  # documented where users look


def test_console_script_dispatch(capsys):
    """`xpyd doctor` through the `xpyd` command (xpyd_deploy/cli.py)."""
    assert xpyd_cli.main(["--help"]) == 0
    assert xpyd_cli.main([]) == 2
    assert xpyd_cli.main(["nurse"]) == 2
    assert "unknown command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        xpyd_cli.main(["doctor", "--bogus"])
    assert e.value.code == 2
    assert "usage: xpyd doctor" in capsys.readouterr().err
