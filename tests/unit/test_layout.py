"""The suite's layout (issue 37): tiers in tests/unit, tests/e2e, tests/deploy; shared code in one
package, tests/support, imported as tests.support.X (scripts/ as scripts.X) from the repository
root. No test module imports another test module, and nothing under tests/ or scripts/ edits
sys.path: imports resolve the same way under pytest, `python -m scripts.NAME` and a subprocess."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIERS = ("unit", "e2e", "deploy")


def sources() -> list[Path]:
    return sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])


def local_modules() -> set[str]:
    """Names a bare `import X` would have meant a file beside the tests or scripts."""
    names = {p.stem for p in sources()} - {"__init__"}
    return names | {"support", "unit", "e2e", "deploy"}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, "." * node.level + (node.module or "")))
            if node.module in ("tests", "tests.unit", "tests.e2e", "tests.deploy", "tests.support", "scripts"):
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def import_problems(text: str, local: set[str]) -> list[str]:
    """A test module or conftest imported (by any spelling), a relative import, or a local module
    imported bare (which only resolves through a sys.path edit or the importer's folder)."""
    problems = []
    for line, mod in imported_modules(ast.parse(text)):
        parts = mod.lstrip(".").split(".")
        if mod.startswith("."):
            problems.append(f"{line}: relative import {mod} (use tests.support.X / scripts.X)")
        elif any(p.startswith("test_") or p == "conftest" for p in parts):
            problems.append(f"{line}: imports the test module {mod} (shared code goes in tests/support)")
        elif parts[0] in local and parts[0] not in ("tests", "scripts"):
            problems.append(f"{line}: bare import of {mod} (tests.support.{mod} or scripts.{mod})")
    return problems


def _is_sys_path(node: ast.AST) -> bool:
    while isinstance(node, ast.Subscript):
        node = node.value
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_edits(text: str) -> list[str]:
    """sys.path changed in place (insert/append/extend/...) or assigned (whole, a slice, +=).
    Reading it is fine, and so is pytest's monkeypatch, which puts it back after the test."""
    edits = []
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value)
                and node.func.attr in ("insert", "append", "extend", "remove", "pop", "clear", "__setitem__")):
            edits.append(f"{node.lineno}: sys.path.{node.func.attr}(...)")
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        edits += [f"{node.lineno}: assigns sys.path" for t in targets if _is_sys_path(t)]
    return edits


def test_no_test_module_imports_another_and_nothing_is_imported_bare():
    local = local_modules()
    found = {str(p.relative_to(ROOT)): pr for p in sources() if (pr := import_problems(p.read_text(), local))}
    assert not found, found


def test_nothing_under_tests_or_scripts_edits_sys_path():
    found = {str(p.relative_to(ROOT)): e for p in sources() if (e := sys_path_edits(p.read_text()))}
    assert not found, found


@pytest.mark.parametrize("text", [
    "import test_connector_engine as te",
    "from test_connector_engine import make_cfg",
    "from tests.unit.test_connector_engine import make_cfg",
    "from tests.unit import test_connector_engine",
    "def f():\n    from tests import conftest",
    "from .kv_engines import make_cfg",
    "import fake_vllm",
    "from proxy_helpers import running_proxy",
    "from bench_e2e import histogram_sums",
])
def test_the_import_check_catches(text):
    assert import_problems(text, local_modules())


@pytest.mark.parametrize("text", [
    "from tests.support.kv_engines import make_cfg",
    "from tests.support import e2e_cluster",
    "from scripts.bench_e2e import histogram_sums",
    "from scripts import bench_e2e",
    "from xpyd_deploy.topology import load_topology",
    "import proxy.config",
])
def test_the_import_check_passes(text):
    assert not import_problems(text, local_modules())


@pytest.mark.parametrize("text", [
    "import sys\nsys.path.insert(0, 'x')",
    "import sys\nsys.path.append('x')",
    "import sys\nsys.path[:0] = ['x']",
    "import sys\nsys.path = ['x']",
    "import sys\nsys.path += ['x']",
    "import sys\ndef f():\n    sys.path.extend(['x'])",
])
def test_the_sys_path_check_catches(text):
    assert sys_path_edits(text)


def test_the_sys_path_check_lets_reads_and_monkeypatch_pass():
    assert not sys_path_edits("import sys\nx = sys.path[0]\nmonkeypatch.setattr('sys.path', [])")


def marks(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"):
            found.add(node.attr)
    return found


def test_the_tiers_hold_what_their_names_say():
    """Top level: the conftest and the four packages. unit/ needs no vLLM server and no external
    binary (its GPU tests skip without CUDA); e2e/ starts real vLLM; deploy/ runs docker or a tool
    (haproxy, prometheus, kubectl). The `unit` marker (tests/conftest.py) is what the tiers run by."""
    top = {p.name for p in (ROOT / "tests").iterdir() if p.name != "__pycache__"}
    assert top == {"__init__.py", "conftest.py", "support", *TIERS}, top
    wrong = []
    for tier in TIERS:
        assert (ROOT / "tests" / tier / "__init__.py").exists()
        for p in sorted((ROOT / "tests" / tier).glob("test_*.py")):
            m = marks(p)
            text = p.read_text()
            ok = {"unit": not m & {"vllm", "docker", "tool"},
                  "e2e": "vllm" in m and not m & {"docker", "tool"},
                  "deploy": bool(m & {"docker", "tool"}) or "haproxy_helpers import HAPROXY, SKIP_REASON" in text}[tier]
            if not ok:
                wrong.append(f"{p.relative_to(ROOT)}: marks {sorted(m)}")
    assert not wrong, wrong
    assert not list((ROOT / "tests" / "support").glob("test_*.py"))
