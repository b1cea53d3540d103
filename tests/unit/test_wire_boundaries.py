"""proxy/ and connector/ share wire formats only through xpyd_wire/, never import each other,
and xpyd_wire/ imports neither (issue 17, part 6)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "connector", "xpyd_wire")


def _imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, anywhere in it (function-level imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _violations(package: str, forbidden: set[str]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_packages(path) & forbidden
        if bad:
            out.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    return out


def test_proxy_does_not_import_connector():
    assert _violations("proxy", {"connector"}) == []


def test_connector_does_not_import_proxy():
    assert _violations("connector", {"proxy"}) == []


def test_wire_imports_neither_side_nor_heavy_modules():
    assert _violations("xpyd_wire", {"proxy", "connector", "torch", "vllm", "zmq"}) == []


def test_scanner_sees_function_level_imports(tmp_path):
    # The check above must be able to fail: a nested import is found.
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from connector import request_id\n    import proxy.app\n")
    assert _imported_packages(mod) >= {"connector", "proxy"}


def test_both_sides_use_the_wire_package():
    assert "xpyd_wire" in set().union(*(_imported_packages(p) for p in (ROOT / "proxy").rglob("*.py")))
    assert "xpyd_wire" in set().union(*(_imported_packages(p) for p in (ROOT / "connector").rglob("*.py")))
