"""Walk a traced step the way a GPU runs it: every equation of the program, the sub-jaxprs of
calls, conditionals and loops included, Pallas / Mosaic GPU kernel bodies not entered (there a
branch or a dot is the kernel's own instruction, not an XLA op)."""

from __future__ import annotations

import collections

from serving.cache.step_temps import KERNELS, sub_jaxprs  # noqa: F401 - kernel calls: not entered


def outer_eqns(jaxpr):
    """Every equation of `jaxpr` (a Jaxpr) and its sub-jaxprs, outside kernel bodies."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in sub_jaxprs(eqn):
            yield from outer_eqns(inner)


def primitive_counts(jaxpr) -> collections.Counter:
    """Primitive name -> how many equations of `outer_eqns(jaxpr)` use it."""
    return collections.Counter(eqn.primitive.name for eqn in outer_eqns(jaxpr))
