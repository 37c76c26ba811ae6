"""What the distribution installs: the three layers of the service, and not the repository's tools.

softmoe_models, export and server are installed (the `softmoe` entry point lives in server, and
`softmoe serve` / `softmoe export` are the serving runtime); loadtests and tests run from the
checkout (`python -m loadtests.bench` at the repository root) and must not land in site-packages
as top-level packages with generic names. Checked with setuptools' own discovery on the
``[tool.setuptools.packages.find]`` table, so no wheel has to be built.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import setuptools

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"softmoe_models", "export", "server"}


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def discovered(find: dict) -> set[str]:
    """The packages setuptools installs for a ``packages.find`` table (its defaults included:
    ``where = ["."]``, ``namespaces = true`` in pyproject.toml)."""
    finder = setuptools.find_namespace_packages if find.get("namespaces", True) else setuptools.find_packages
    packages: set[str] = set()
    for where in find.get("where", ["."]):
        packages |= set(finder(where=str(ROOT / where), include=find.get("include", ["*"]),
                               exclude=find.get("exclude", [])))
    return packages


def test_only_the_three_layers_are_installed(pyproject):
    packages = discovered(pyproject["tool"]["setuptools"]["packages"]["find"])
    assert {p.split(".")[0] for p in packages} == LAYERS, sorted(packages)
    for tool in ("loadtests", "tests"):
        assert not any(p == tool or p.startswith(tool + ".") for p in packages), sorted(packages)
    # every sub-package of the layers comes along
    for layer in LAYERS:
        for init in (ROOT / layer).rglob("__init__.py"):
            name = ".".join(init.parent.relative_to(ROOT).parts)
            assert name in packages, f"{name} is not installed"


def test_the_discovery_check_can_fail():
    """The include list the repository had: loadtests shows up, so the test above would fail on it."""
    packages = discovered({"include": ["softmoe_models*", "export*", "server*", "loadtests*"]})
    assert "loadtests" in packages


def test_the_entry_point_is_the_top_layer(pyproject):
    target = pyproject["project"]["scripts"]["softmoe"]
    module, _, attr = target.partition(":")
    assert module.split(".")[0] == "server", f"softmoe = {target!r}: the command line is composed at the top"
    assert callable(getattr(importlib.import_module(module), attr))
