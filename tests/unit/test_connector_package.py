"""connector/'s shape (issue 50, section 3), as vLLM keeps v1/nixl/ and v1/mooncake/: each
connector its own wing, what both use at the root.

- root: the shared vocabulary (config, base, registration, stats, tracing, layout, affinity, log,
  scheduler_output), importing only the root and transport/ (stats names its refusal reasons);
- p2p/: P2pNcclConnector, importing the root, transport/ and itself;
- shared_storage/: SharedStorageConnector, importing the root and itself, never p2p/;
- transport/: the message + tensors RPC p2p/ and the tools use, importing the root's affinity and log;
- tools/: operator tools, not loaded by vLLM: may import any wing.

No module takes a private name (``_x``) from another module of another area, and the config
string vLLM is given (``kv_connector_module_path: connector``) still finds both classes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = ROOT / "connector"
ROOT_MODULES = {"__init__", "affinity", "base", "config", "layout", "log", "registration", "scheduler_output",
                "server_args", "stats", "tracing"}
WINGS = {"p2p", "shared_storage", "transport", "tools"}
# area -> the areas its modules may import ("root" is connector/*.py)
ALLOWED = {
    "root": {"root", "transport"},
    "transport": {"root", "transport"},
    "p2p": {"root", "transport", "p2p"},
    "shared_storage": {"root", "shared_storage"},
    "tools": {"root", "transport", "p2p", "shared_storage", "tools"},
}
# connector/__init__.py is the name vLLM's config gives: it imports each wing's class lazily.
ENTRY = "connector"


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else "root"


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def connector_imports(path: Path, text: str | None = None) -> list[tuple[str, list[str]]]:
    """(module imported, names taken) for every import of connector.* anywhere in the file (or
    in ``text``, as if it were that file); relative imports resolved against its package."""
    pkg = module_of(path) if path.name == "__init__.py" else module_of(path).rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "connector"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "connector":
                continue
            names = [a.name for a in node.names]
            # `from connector.p2p import tp` imports the module connector.p2p.tp
            subs = [n for n in names if (ROOT / Path(*mod.split("."), f"{n}.py")).exists()
                    or (ROOT / Path(*mod.split("."), n)).is_dir()]
            out += [(f"{mod}.{n}", []) for n in subs]
            if len(subs) < len(names):
                out.append((mod, [n for n in names if n not in subs]))
    return out


def modules() -> list[Path]:
    return sorted(p for p in CONNECTOR.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_root_holds_the_shared_modules_and_the_wings():
    assert {p.stem for p in CONNECTOR.glob("*.py")} == ROOT_MODULES
    assert {p.name for p in CONNECTOR.iterdir() if p.is_dir() and p.name != "__pycache__"} == WINGS
    for wing in WINGS:
        assert (CONNECTOR / wing / "__init__.py").read_text().startswith('"""'), f"{wing}/__init__.py says what it owns"


def test_the_import_arrows_run_into_the_root_never_across_the_wings():
    wrong = {}
    for p in modules():
        me = module_of(p)
        if me == ENTRY:
            continue
        bad = sorted({m for m, _ in connector_imports(p) if area(m) not in ALLOWED[area(me)]})
        if bad:
            wrong[me] = bad
    assert wrong == {}, wrong


def test_no_private_name_is_taken_from_another_area():
    wrong = {}
    for p in modules():
        me = module_of(p)
        taken = [f"{m}.{n}" for m, names in connector_imports(p) for n in names
                 if n.startswith("_") and area(m) != area(me)]
        if taken:
            wrong[me] = taken
    assert wrong == {}, wrong


def test_the_checks_see_what_they_look_for():
    text = ("from connector.p2p import tp\nfrom connector.config import _private\nfrom . import keys\n"
            "def f():\n    from connector.p2p.scheduler import P2pScheduler\n")
    found = connector_imports(CONNECTOR / "shared_storage" / "imagined.py", text)
    assert ("connector.p2p.tp", []) in found and ("connector.config", ["_private"]) in found
    assert ("connector.shared_storage.keys", []) in found and ("connector.p2p.scheduler", ["P2pScheduler"]) in found
    assert [area(m) for m, _ in found] == ["p2p", "root", "shared_storage", "p2p"]


def test_the_config_string_finds_both_connectors():
    pytest.importorskip("vllm")
    import connector

    assert connector.P2pNcclConnector.__module__ == "connector.p2p.connector"
    assert connector.SharedStorageConnector.__module__ == "connector.shared_storage.connector"
