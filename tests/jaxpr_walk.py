"""Walk a traced step the way a GPU runs it: every equation of the program, the sub-jaxprs of
calls, conditionals and loops included, Pallas / Mosaic GPU kernel bodies not entered (there a
branch or a dot is the kernel's own instruction, not an XLA op)."""

from __future__ import annotations

import collections

KERNELS = frozenset({"pallas_call", "mpmd_map"})  # Pallas / Mosaic GPU kernel calls


def outer_eqns(jaxpr):
    """Every equation of `jaxpr` (a Jaxpr) and its sub-jaxprs, outside kernel bodies."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in KERNELS:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    yield from outer_eqns(inner)


def primitive_counts(jaxpr) -> collections.Counter:
    """Primitive name -> how many equations of `outer_eqns(jaxpr)` use it."""
    return collections.Counter(eqn.primitive.name for eqn in outer_eqns(jaxpr))
