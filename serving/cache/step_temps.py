"""The bytes a traced program holds besides its arguments: a liveness walk over its jaxpr.

XLA's own figure (`compiled.memory_analysis().temp_size_in_bytes`) needs a compile; the default
KV pool is sized before any step is compiled (serving/cache/kv_pool.py), so it reads this
estimate of the engine step's temporaries instead, from a trace (about a second at the 8B shape).

The walk follows the equations in program order. An equation's outputs are live from it to
their last use, except a value an elementwise or layout op (FUSIBLE) makes for readers of that
kind only: XLA fuses those into one loop, so it is no buffer (its operands stay live until the
loop's last reader instead). An output may take the buffer of an operand of the same byte size
that dies at that equation and is read by it directly (XLA does the same: an in-place update of
a donated page array, a reshape), so writes into the donated KV pool cost nothing; a reshape
of a value that lives on is a view of it (no bytes; the value stays live while the view is read,
and is not written in place before that). Arguments
are never counted. A call (pjit, custom_jvp, a loop body) adds its own peak while it runs;
Pallas / Mosaic kernel bodies are not entered (their outputs count, their scratch does not).
Checked against XLA's figures on the host: the overflow step's key pre-rotation at the tulu3
shape 8.25 GiB both; a 2-layer tulu3 step 0.91 GiB against XLA's 1.05 GiB.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core

from serving.cache.xla_limit import ProgramBytes

KERNELS = frozenset({"pallas_call", "mpmd_map"})  # kernel calls: bodies not entered
# elementwise and layout ops XLA fuses into their readers' loops (a value one of them makes for
# readers of this set only is never a buffer of its own)
FUSIBLE = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "exp", "exp2", "log", "log1p", "logistic",
    "tanh", "sin", "cos", "sqrt", "rsqrt", "abs", "sign", "integer_pow", "pow", "erf", "square",
    "convert_element_type", "select_n", "clamp", "and", "or", "not", "eq", "ne", "lt", "le",
    "gt", "ge", "broadcast_in_dim", "slice", "concatenate", "squeeze", "expand_dims", "copy"})
LAYOUT = frozenset({"convert_element_type", "broadcast_in_dim", "slice", "squeeze",
                    "expand_dims", "copy"})  # free to recompute in every reader's loop
# ops whose output XLA gives its operand's buffer (a bitcast of a row-major array): no bytes of
# their own, and the operand stays live while the view is read (the flat page view a kernel
# reads while the pages are written later in the step: counted as a copy of the pool before)
VIEWS = frozenset({"reshape"})


def nbytes(aval) -> int:
    """Bytes of an array aval (0 for tokens and other non-arrays)."""
    if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
        return 0
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def sub_jaxprs(eqn):
    """The sub-jaxprs of `eqn` (calls, conditionals, loops), none inside a kernel call."""
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
    last_use, fused = _liveness(jaxpr)
    views = _views(jaxpr, last_use)
    dies_at: dict = {}  # equation index -> the vars last used there (read, or read fused)
    for v, i in last_use.items():
        dies_at.setdefault(i, []).append(v)
    held: dict = {}  # var -> the bytes it counts (0: an argument, or a buffer taken over)
    live = peak = 0
    for i, eqn in enumerate(jaxpr.eqns):
        inner = max((peak_bytes(sub) for sub in sub_jaxprs(eqn)), default=0)
        dying = dies_at.get(i, [])
        new = unread = 0
        for v in eqn.outvars:
            size = 0 if v in fused or v in views else nbytes(v.aval)
            # a view gives its buffer away only when its base dies with it (else XLA copies)
            donor = next((d for d in dying if size and d not in fused and d in eqn.invars
                          and held.get(d, 0) != -1 and nbytes(d.aval) == size
                          and last_use.get(views.get(d, d), i) <= i), None)
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


def _views(jaxpr, last_use) -> dict:
    """view var -> its base (the first non-view operand up the chain), for the VIEWS equations
    of `jaxpr`; each base's last use extended to its views' (in place in `last_use`)."""
    views: dict = {}
    for eqn in jaxpr.eqns:
        src = eqn.invars[0] if eqn.invars else None
        if eqn.primitive.name in VIEWS and isinstance(src, core.Var):
            views[eqn.outvars[0]] = views.get(src, src)
    for view, base in views.items():
        if view in last_use and base in last_use:
            last_use[base] = max(last_use[base], last_use[view])
    return views


def _liveness(jaxpr):
    """(last_use: var -> index of the last equation reading it, len(eqns) for outputs; fused:
    the vars an elementwise equation makes for elementwise readers only, never materialised,
    XLA's loop fusion; one with several readers only when its own operands are buffers). A fused var's operands live until the fused var's own last reader."""
    last_use: dict = {}
    readers: dict = {}  # var -> the equations reading it
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, core.Var):
                last_use[v] = i
                readers.setdefault(v, {})[i] = eqn.primitive.name
    for v in jaxpr.outvars:
        if isinstance(v, core.Var):
            last_use[v] = len(jaxpr.eqns)
            readers.setdefault(v, {})[-1] = "output"
    fused: set = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in FUSIBLE:
            continue
        # a value read by several loops is recomputed in each when it is a layout op or reads
        # buffers only: a residual stream (h + x, read by the next norm and the next residual
        # add, h itself such a sum) is a buffer
        from_buffers = eqn.primitive.name in LAYOUT or not any(
            v in fused for v in eqn.invars if isinstance(v, core.Var))
        fused.update(v for v in eqn.outvars if isinstance(v, core.Var) and readers.get(v)
                     and set(readers[v].values()) <= FUSIBLE
                     and (len(readers[v]) == 1 or from_buffers))
    for eqn in reversed(jaxpr.eqns):
        for out in (v for v in eqn.outvars if v in fused):
            for v in eqn.invars:
                if isinstance(v, core.Var):
                    last_use[v] = max(last_use[v], last_use[out])
    return last_use, fused


def program_bytes(jaxpr, donated) -> ProgramBytes:
    """A traced program's bytes as XLA will count them (serving/cache/xla_limit.py): `peak_bytes`
    as its temporaries, its inputs as arguments, its outputs, and as aliased the outputs that
    take a donated input's buffer (`donated`: per flat input; JAX gives each output the first
    unused donated input of the same shape and dtype, in order)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    free: dict = {}  # (shape, dtype) -> donated inputs not yet taken
    for v, d in zip(jaxpr.invars, donated):
        if d:
            key = (tuple(v.aval.shape), np.dtype(v.aval.dtype))
            free[key] = free.get(key, 0) + 1
    alias = 0
    for v in jaxpr.outvars:
        key = (tuple(getattr(v.aval, "shape", ())), np.dtype(getattr(v.aval, "dtype", "int8")))
        if free.get(key):
            free[key] -= 1
            alias += nbytes(v.aval)
    return ProgramBytes(temp=peak_bytes(jaxpr), alias=alias,
                        argument=sum(nbytes(v.aval) for v in jaxpr.invars),
                        output=sum(nbytes(v.aval) for v in jaxpr.outvars))


def step_programs(runner, args_of, step_fn, donate_argnums=()) -> list:
    """`program_bytes` of the top token bucket's general variants (runner.warmup_steps(); a
    hybrid's span steps too, which it warms and runs under the same compile options;
    args_of(ints, floats, use_prev, kw) and step_fn(*args, **kw) are the runner's own; every
    attention plan it readies, the overflow plan included), traced from runner.cache as it
    stands (an abstract pool is enough: writes into the pool take its buffers), the arguments
    at `donate_argnums` donated. Smaller buckets hold no more (their largest buffers are
    per-sequence tables, or scale with the bucket)."""
    top = runner.config.token_buckets[-1]
    out = []
    for ints, floats, kw in runner.warmup_steps(spans=runner.hybrid):
        if "compose" in kw or kw["t"] != top or kw["decode_only"]:
            continue
        args = list(args_of(ints, floats, False, kw))
        args[2] = jax.ShapeDtypeStruct(ints.shape, ints.dtype)
        args[3] = jax.ShapeDtypeStruct(floats.shape, floats.dtype)
        donated = [i in donate_argnums for i, a in enumerate(args)
                   for _ in jax.tree.leaves(a)]
        jaxpr = jax.make_jaxpr(lambda *a, kw=kw: step_fn(*a, **kw))(*args)
        out.append(program_bytes(jaxpr, donated))
    return out


def step_reserve(runner, args_of, step_fn) -> int:
    """Bytes to leave free for the engine step's temporaries: the largest `peak_bytes` over
    `step_programs` (the top token bucket's general variants)."""
    return max((p.temp for p in step_programs(runner, args_of, step_fn)), default=0)
