"""The wheel that `pip install xpyd` (and scripts/gpu_check.sh) installs: every module of the
checkout is in it, and every third-party package its modules import at load time is a declared
dependency (a GPU machine with torch alone got neither: connector.transport was left out of the
wheel, and numpy, which the transports import, was not declared)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "connector", "xpyd_wire", "xpyd_deploy")
# Imported at load time by modules that only run where their package is there anyway.
NOT_REQUIRED = {
    "vllm": "the connector's vLLM-facing modules are loaded by vLLM itself (extra `vllm`)",
    "starlette": "fastapi's own foundation: a fastapi install has it",
    "aiohttp": "proxy/upstream/aiohttp_client.py, loaded only for --upstream-client aiohttp",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # A copy of what the build reads: setuptools' build/ folder in the checkout may hold
    # modules of an earlier build.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    # setuptools (>= 70.1 builds wheels itself) from this environment: no index needed.
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("xpyd-*.whl")
    with zipfile.ZipFile(whl) as z:
        yield z


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_is_in_the_wheel(wheel):
    assert _modules()
    missing = {p.relative_to(ROOT).as_posix() for p in _modules()} - set(wheel.namelist())
    assert not missing, f"left out of the wheel: {sorted(missing)}"


def _load_time_imports(path: Path) -> set[str]:
    """Top-level names imported in the module's body (not inside a function, a try or an if):
    what `import module` needs."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_what_the_modules_import_is_declared(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    declared = {_norm(re.split(r"[\s;<>=!~\[(]", line.split(":", 1)[1].strip(), maxsplit=1)[0])
                for line in wheel.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    dists = md.packages_distributions()
    undeclared = {}
    for path in _modules():
        for name in _load_time_imports(path):
            if name in sys.stdlib_module_names or name in PACKAGES or name in NOT_REQUIRED or name == "__future__":
                continue
            owners = {_norm(d) for d in dists.get(name, [name])}
            if not owners & declared:
                undeclared.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    assert not undeclared, f"imported at load time but not a declared dependency: {undeclared}"
