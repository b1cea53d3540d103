"""proxy/ keeps the shape issue 38 gave it: a small root of shared vocabulary and wings
(serving, dispatch, routing, upstream, membership), no import circle between its modules
(function-level imports count: a deferred import only hides a circle), no package
__init__ that imports, and no module over ~500 lines unless it is listed here with its one job."""

from __future__ import annotations

import ast
from pathlib import Path

from xpyd_wire.headers import XPYD_PREFIX

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "proxy"

ROOT_MODULES = {
    "__init__", "__main__", "api_routes", "asgi", "config", "config_help", "credentials", "deadline", "errors",
    "loop_metrics", "metrics", "openai_api", "registry", "request", "secret_files", "tracing",
}  # fmt: skip
WINGS = {"serving", "dispatch", "routing", "upstream", "membership"}
MAX_LINES = 500
# Over MAX_LINES, each with its one job; a module may only shrink below its figure here.
LONG_MODULES = {
    # The rules of the first token from P, one allow-list and the translation of D's events
    # that tests reach through the module (first_token.X).
    "proxy/dispatch/first_token.py": 615,
    # The KV-event intake: one class (KVEvents) owning every instance's SUB sockets.
    "proxy/routing/kv_events.py": 630,
}


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: Path, module_level_only: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in it (function-level
    and TYPE_CHECKING imports too, unless module_level_only); `from pkg import name` counts
    pkg.name when that is a module."""
    base = package.parent
    paths = {module_name(p, base): p for p in sorted(package.rglob("*.py"))}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = _outside_functions(tree) if module_level_only else ast.walk(tree)
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    mod = ".".join(parts + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if (r := resolve(t)) is not None and r != name:
                    found.add(r)
        graph[name] = found
    return graph


def _outside_functions(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield node
            yield from _outside_functions(node)


def wing_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "root"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_in_proxy():
    assert cycles(import_graph(PROXY)) == []


def test_wings_form_no_circle_and_the_root_imports_no_wing():
    """Between wings too: serving -> dispatch -> routing/upstream, never back. The root is
    vocabulary: it imports no wing when loaded (config parses --prefill/--decode with
    membership/static.py in a function; __main__ is the entry point and starts serving/)."""
    graph = import_graph(PROXY)
    wings: dict[str, set[str]] = {w: set() for w in WINGS}
    for mod, deps in graph.items():
        if wing_of(mod) != "root":
            wings[wing_of(mod)].update(wing_of(d) for d in deps if wing_of(d) not in ("root", wing_of(mod)))
    assert cycles(wings) == []
    loaded = import_graph(PROXY, module_level_only=True)
    assert {m: sorted(d for d in deps if wing_of(d) != "root")
            for m, deps in loaded.items() if wing_of(m) == "root" and m != "proxy.__main__"
            and any(wing_of(d) != "root" for d in deps)} == {}  # fmt: skip


def test_the_check_sees_a_circle_closed_by_a_deferred_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "wing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "wing" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.wing import b\n")
    (pkg / "wing" / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    graph = import_graph(pkg)
    assert graph["pkg.c"] == {"pkg", "pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.wing.b"]]
    assert cycles(import_graph(pkg, module_level_only=True)) == []  # deferred: seen only by the full scan


def test_root_holds_the_vocabulary_and_the_rest_lives_in_wings():
    assert {p.stem for p in PROXY.glob("*.py")} == ROOT_MODULES
    assert {p.name for p in PROXY.iterdir() if p.is_dir() and p.name != "__pycache__"} == WINGS


def test_package_inits_import_nothing():
    # An __init__ that imports its modules would put the package on every import path.
    for init in PROXY.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], init


def test_no_proxy_module_over_500_lines_unless_listed():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PROXY.rglob("*.py")}
    over = {p: n for p, n in sizes.items() if n > MAX_LINES and p not in LONG_MODULES}
    assert over == {}
    for path, cap in LONG_MODULES.items():
        assert MAX_LINES < sizes[path] <= cap, (path, sizes[path])


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """The module's string constants, docstrings left out (prose may name a header)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}  # fmt: skip
    return [(n.lineno, n.value if isinstance(n.value, str) else n.value.decode("latin-1"))
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes)) and id(n) not in docs]  # fmt: skip


def test_xpyd_header_names_are_spelled_only_in_the_wire_package():
    # xpyd_wire/headers.py owns the x-xpyd-* names; proxy/ and tests/ use its constants.
    found = [f"{p.relative_to(ROOT)}:{line}"
             for tree in (PROXY, ROOT / "tests") for p in sorted(tree.rglob("*.py"))
             for line, text in _string_literals(p) if XPYD_PREFIX in text]  # fmt: skip
    assert found == []
    assert XPYD_PREFIX in {t for _, t in _string_literals(ROOT / "xpyd_wire" / "headers.py")}
