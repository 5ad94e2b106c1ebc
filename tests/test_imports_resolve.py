"""Every first-party `from X import Y` names something X defines, including imports inside
functions that only run on a GPU or in a benchmark (a renamed helper once broke
`minipic-bench engine` on the H200 while the whole suite passed). Each module is imported once;
no function runs."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "kernels_pallas", "planner", "serving", "minipic_jax", "benchmarks")


def _from_imports():
    """(file, line, module, name) of every absolute first-party `from module import name`."""
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] in PACKAGES):
                    for alias in node.names:
                        yield path.relative_to(REPO), node.lineno, node.module, alias.name


def test_every_first_party_from_import_resolves():
    missing = []
    for path, line, module, name in _from_imports():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            pytest.fail(f"{path}:{line}: cannot import {module}: {e}")
        if name == "*" or hasattr(mod, name):
            continue
        try:  # `from package import submodule`
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            missing.append(f"{path}:{line}: {module} has no {name!r}")
    assert not missing, "stale imports:\n" + "\n".join(missing)
