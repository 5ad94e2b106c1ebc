"""Kernels are reached through their ops' api modules, and only public JAX is imported: models
and the engine import gated delta through kernels_pallas/gated_delta/api.py (where its kernel
choice is made), and `jax._src` appears only in tests and kernels_pallas/jax_internals.py (one
small helper per internal JAX does not export). Read from the source (ast); nothing imported."""

from __future__ import annotations

import ast

from test_layering import MAY_IMPORT, REPO, _graph

JAX_INTERNALS_HELPER = REPO / "kernels_pallas" / "jax_internals.py"


def test_models_reach_gated_delta_through_its_api():
    mods, graph = _graph()
    around = [f"{mods[m].relative_to(REPO)}:{line} imports {t}"
              for m, edges in graph.items() if m.split(".")[0] in ("minipic_jax", "serving")
              for t, line in edges
              if t.startswith("kernels_pallas.gated_delta.")
              and t != "kernels_pallas.gated_delta.api"]
    assert not around, "use kernels_pallas.gated_delta.api:\n" + "\n".join(around)


def _jax_internal_imports(path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            if name == "jax._src" or name.startswith("jax._src."):
                yield node.lineno, name


def test_no_jax_internals_outside_tests():
    found = [f"{path.relative_to(REPO)}:{line} imports {name}"
             for pkg in MAY_IMPORT for path in sorted((REPO / pkg).rglob("*.py"))
             if path != JAX_INTERNALS_HELPER
             for line, name in _jax_internal_imports(path)]
    assert not found, ("import public JAX, or add a helper to kernels_pallas/jax_internals.py:\n"
                       + "\n".join(found))
