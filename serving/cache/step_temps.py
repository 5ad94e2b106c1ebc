"""The bytes a traced program holds besides its arguments: a liveness walk over its jaxpr.

XLA's own figure (`compiled.memory_analysis().temp_size_in_bytes`) needs a compile; the default
KV pool is sized before any step is compiled (serving/cache/kv_pool.py), so it reads this
estimate of the engine step's temporaries instead, from a trace (about a second at the 8B shape).

The walk follows the equations in program order. An equation's outputs are live from it to their
last use; an output may take the buffer of an operand of the same byte size that dies at that
equation (XLA does the same: an in-place update of a donated page array, a reshape, an
elementwise op over a dead input), so writes into the donated KV pool cost nothing. Arguments
are never counted. A call (pjit, custom_jvp, a loop body) adds its own peak while it runs;
Pallas / Mosaic kernel bodies are not entered (their outputs count, their scratch does not).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core

KERNELS = frozenset({"pallas_call", "mpmd_map"})  # kernel calls: bodies not entered


def nbytes(aval) -> int:
    """Bytes of an array aval (0 for tokens and other non-arrays)."""
    if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
        return 0
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _sub_jaxprs(eqn):
    if eqn.primitive.name in KERNELS:
        return
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


def peak_bytes(jaxpr) -> int:
    """Most bytes of intermediates live at once in `jaxpr` (a Jaxpr or ClosedJaxpr), outputs
    included, arguments not (see the module docstring for the rules)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    last_use: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, core.Var):
                last_use[v] = i
    end = len(jaxpr.eqns)
    for v in jaxpr.outvars:
        if isinstance(v, core.Var):
            last_use[v] = end
    held: dict = {}  # var -> the bytes it counts (0: an argument, or a buffer taken over)
    live = peak = 0
    for i, eqn in enumerate(jaxpr.eqns):
        inner = max((peak_bytes(sub) for sub in _sub_jaxprs(eqn)), default=0)
        dying = list(dict.fromkeys(v for v in eqn.invars
                                   if isinstance(v, core.Var) and last_use.get(v) == i))
        new = unread = 0
        for v in eqn.outvars:
            size = nbytes(v.aval)
            donor = next((d for d in dying
                          if held.get(d, 0) != -1 and nbytes(d.aval) == size), None)
            if donor is not None:  # the output takes the dying operand's buffer
                counted = held.get(donor, 0)
                held[donor] = -1  # given away: its death frees nothing
            else:
                counted = size
                new += size
            if isinstance(v, core.Var) and v in last_use:
                held[v] = counted
            else:
                unread += counted  # an output nobody reads is freed after this equation
        peak = max(peak, live + max(inner, new))
        live += new - unread
        for v in dying:
            live -= max(held.pop(v, 0), 0)
    return peak



def step_reserve(runner, args_of, step_fn) -> int:
    """Bytes to leave free for the engine step's temporaries: the largest `peak_bytes` over the
    top token bucket's general variants (runner.warmup_steps(); args_of(ints, floats, use_prev,
    kw) and step_fn(*args, **kw) are the runner's own; every attention plan it readies,
    the overflow plan included), traced from runner.cache as it stands (an abstract pool is
    enough: writes into the pool take its buffers). Smaller buckets hold no more (their
    largest buffers are per-sequence tables, or scale with the bucket)."""
    top = runner.config.token_buckets[-1]
    peak = 0
    for ints, floats, kw in runner.warmup_steps():
        if kw["t"] != top or kw["decode_only"]:
            continue
        args = list(args_of(ints, floats, False, kw))
        args[2] = jax.ShapeDtypeStruct(ints.shape, ints.dtype)
        args[3] = jax.ShapeDtypeStruct(floats.shape, floats.dtype)
        jaxpr = jax.make_jaxpr(lambda *a, kw=kw: step_fn(*a, **kw))(*args)
        peak = max(peak, peak_bytes(jaxpr))
    return peak
