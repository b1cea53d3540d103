"""Each package folder has a README (issue 50, section 3): what the package is, a reading path
and "where does my change go?". Every module or file a README names in backticks exists, so a
move or a rename that leaves a README behind fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "connector", "xpyd_wire", "xpyd_deploy")
TOP = ("proxy/", "connector/", "xpyd_wire/", "xpyd_deploy/", "tests/", "scripts/", "configs/", "docs/", "docker-compose.yml")


def named_paths(text: str) -> list[str]:
    """Backticked file names (`x.py`, `dir/x.py`, `docs/a.md`), placeholders and globs left out."""
    return [m for m in re.findall(r"`([\w./-]+\.(?:py|md|yaml|yml|cfg))`", text) if "<" not in m and "*" not in m]


def resolve(package: str, name: str) -> list[Path]:
    """Where a name may live: from the root when it starts with a top-level folder, else anywhere
    under the package (the reading paths name modules of a wing by their bare name)."""
    if name.startswith(TOP):
        return [ROOT / name]
    return [ROOT / package / name, *(ROOT / package).rglob(Path(name).name)]


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_has_a_readme_with_its_reading_path(package):
    text = (ROOT / package / "README.md").read_text(encoding="utf-8")
    assert text.startswith(f"# {package}/")
    assert "## Reading path" in text and "## Where does my change go?" in text


@pytest.mark.parametrize("package", PACKAGES)
def test_what_the_readme_names_exists(package):
    text = (ROOT / package / "README.md").read_text(encoding="utf-8")
    names = named_paths(text)
    assert len(names) >= 5, names
    missing = [n for n in names if not any(p.exists() for p in resolve(package, n))]
    assert missing == [], f"{package}/README.md names files that do not exist: {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_the_reading_path_names_every_module_of_the_package_root(package):
    text = (ROOT / package / "README.md").read_text(encoding="utf-8")
    named = {Path(n).name for n in named_paths(text)}
    left_out = sorted(p.name for p in (ROOT / package).glob("*.py")
                      if p.name not in named and p.stem not in ("__init__", "__main__"))
    assert left_out == [], f"{package}/README.md's reading path leaves out {left_out}"


def test_the_check_catches_a_stale_name():
    assert named_paths("read `gone.py`, then `<name>.py` and `test_*.py`") == ["gone.py"]
    assert not any(p.exists() for p in resolve("connector", "gone.py"))
