"""The docs site: the flag reference matches the config definitions, the site builds strictly,
and the README stays a five-minute read."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ROOT / "docs" / "reference" / "flags.md"
MAX_LINE = 200  # characters, README and docs pages alike
README_MAX_LINES = 250


def _gen_flags():
    spec = importlib.util.spec_from_file_location("gen_flags", ROOT / "scripts" / "gen_flags.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_flags", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_flag_reference_is_generated_from_the_config():
    """docs/reference/flags.md is exactly what scripts/gen_flags.py renders from proxy/config.py
    and the connector's config modules today: a new, renamed or re-defaulted flag or key fails here."""
    rendered = _gen_flags().render()
    assert FLAGS.read_text(encoding="utf-8") == rendered, (
        "docs/reference/flags.md is stale: run `python -m scripts.gen_flags` and commit it")


def test_flag_reference_covers_every_proxy_flag_and_connector_key():
    """Every ProxyConfig field and every extra-config key the connector reads has an entry."""
    import dataclasses

    from proxy.config import ProxyConfig, _flag

    gen = _gen_flags()
    text = gen.render()
    for f in dataclasses.fields(ProxyConfig):
        assert f"### `{_flag(f.name)}`" in text, f.name
    for module_name, _title in gen.CONNECTOR_SOURCES:
        keys = gen.connector_keys(module_name)
        assert keys, module_name
        for key in keys:
            assert f"#### `{key.name}`" in text, key.name


def test_flag_reader_finds_keys_and_defaults_in_source(tmp_path, monkeypatch):
    """The source reader sees each way a key is read (get with and without a default, a
    subscript, the helpers) and evaluates defaults in the module's namespace."""
    pkg = tmp_path / "fakecfg_docs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text(
        "LIMIT = 7.5\n"
        "def _choice(extra, key, allowed): return extra.get(key, allowed[0])\n"
        "def _secret(extra, key, env): return extra.get(key)\n"
        "def build(extra):\n"
        "    a = extra.get('alpha', LIMIT)\n"
        "    b = extra.get('beta')\n"
        "    c = extra['gamma']\n"
        "    d = _choice(extra, 'delta', ('x', 'y'))\n"
        "    e = _secret(extra, 'eps', 'ENV_EPS')\n"
        "    f = extra.get('zeta', a)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = {k.name: k for k in _gen_flags().connector_keys("fakecfg_docs.config")}
    assert set(keys) == {"alpha", "beta", "gamma", "delta", "eps", "zeta"}
    assert keys["alpha"].default == "`7.5`"
    assert keys["beta"].default == "—"
    assert keys["delta"].choices == ("x", "y") and keys["delta"].default == "`x`"
    assert keys["eps"].env == "ENV_EPS"
    assert keys["zeta"].default == "`a`"


def test_gen_flags_check_mode_reports_a_stale_file(tmp_path):
    stale = tmp_path / "flags.md"
    stale.write_text("# old\n")
    script = ["-m", "scripts.gen_flags"]
    done = subprocess.run([sys.executable, *script, "--check", "-o", str(stale)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 1 and "stale" in done.stderr
    done = subprocess.run([sys.executable, *script, "--check"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_readme_is_short_and_lines_are_bounded():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= README_MAX_LINES, len(readme)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    long = [f"{p.relative_to(ROOT)}:{i}" for p in pages
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"lines over {MAX_LINE} characters: {long[:10]}"


def test_readme_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "bash scripts/up.sh" in readme
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_mkdocs_build_strict(tmp_path):
    """mkdocs build --strict: every page in the nav, every link and anchor resolves."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material not installed (pip install -e '.[docs]'; scripts/setup.sh does)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").exists()
