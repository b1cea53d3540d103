"""Deployment is product code (issue 50, section 3): the launcher and the renderers live in
xpyd_deploy/, a package of the wheel with the `xpyd` console script; scripts/ keeps dev tools and
benchmarks. The import arrows: xpyd_deploy -> proxy.config (and the doctor, loaded by `xpyd
doctor` alone); proxy/, connector/, xpyd_wire/ never import xpyd_deploy; nothing in the wheel
imports tests/ or scripts/, and tests/support does not import scripts/."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from xpyd_deploy import cli

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "xpyd_deploy"
MODULES = {"__init__", "__main__", "cli", "topology", "launch", "compose", "k8s", "k8s_autoscaling", "haproxy_cfg"}
# What a module of xpyd_deploy may import from the other packages of the checkout.
ALLOWED = {"proxy.config", "xpyd_deploy"}
ALLOWED_IN = {"cli": {"connector.tools.doctor"}}  # `xpyd doctor`, imported when that subcommand runs


def imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (function-level imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def first_party(mods: set[str]) -> set[str]:
    return {m for m in mods if m.startswith(".") or m.split(".")[0] in
            {"proxy", "connector", "xpyd_wire", "xpyd_deploy", "tests", "scripts"}}


def test_the_package_holds_the_deployment_modules_and_scripts_does_not():
    assert {p.stem for p in DEPLOY.glob("*.py")} == MODULES
    left = [n for n in ("topology", "launch", "compose", "k8s", "haproxy_cfg", "cluster")
            if (ROOT / "scripts" / f"{n}.py").exists()]
    assert left == [], f"deployment code back in scripts/: {left}"


def test_xpyd_deploy_imports_proxy_config_alone():
    wrong = {}
    for p in sorted(DEPLOY.glob("*.py")):
        bad = {m for m in first_party(imports(p))
               if m not in ALLOWED | ALLOWED_IN.get(p.stem, set()) and not m.startswith("xpyd_deploy.")}
        if bad:
            wrong[p.name] = sorted(bad)
    assert wrong == {}, wrong


@pytest.mark.parametrize("package", ["proxy", "connector", "xpyd_wire"])
def test_nothing_in_the_wheel_imports_xpyd_deploy_tests_or_scripts(package):
    wrong = {str(p.relative_to(ROOT)): sorted(bad) for p in sorted((ROOT / package).rglob("*.py"))
             if (bad := {m for m in imports(p) if m.split(".")[0] in {"xpyd_deploy", "tests", "scripts"}})}
    assert wrong == {}, wrong


def test_tests_support_does_not_import_scripts():
    wrong = {p.name: sorted(bad) for p in sorted((ROOT / "tests" / "support").glob("*.py"))
             if (bad := {m for m in imports(p) if m.split(".")[0] == "scripts"})}
    assert wrong == {}, wrong


def test_the_checks_see_what_they_look_for(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import proxy.config\ndef f():\n    from scripts import bench_e2e\n    from connector import engine\n")
    assert first_party(imports(f)) == {"proxy.config", "scripts", "connector"}


def test_the_wheel_ships_the_package_and_the_xpyd_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "xpyd_deploy*" in project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert project["project"]["scripts"]["xpyd"] == "xpyd_deploy.cli:main"


def test_xpyd_launch_runs_the_launcher(capsys):
    assert cli.main(["launch", "list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == sorted(p.stem for p in (ROOT / "configs" / "topologies").glob("*.yaml"))
    assert cli.main(["launch", "commands", "1p1d"]) == 0
    out = capsys.readouterr().out
    assert "# proxy\n" in out and "vllm.entrypoints.openai.api_server" in out
    assert cli.main(["launch", "up", "no-such-layout"]) == 2
    assert "xpyd launch: no topology file 'no-such-layout'" in capsys.readouterr().err


def test_xpyd_without_a_known_command_is_a_usage_error(capsys):
    assert cli.main([]) == 2 and "launch" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert cli.main(["lunch"]) == 2 and "unknown command 'lunch'" in capsys.readouterr().err
