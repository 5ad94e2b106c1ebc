"""Run a function's jaxpr on concrete inputs, one equation at a time, and count the FLOPs of the
dot_generals it runs: loops take their real trip counts and conditionals their taken branch, so
the count is the work the program does for these inputs, not its static shape (a loop whose trip
count is data-dependent counts each iteration it runs)."""

from __future__ import annotations

import math

import jax
from jax.extend import core as jcore

_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


def dot_flops(fn, *args) -> int:
    """2 x multiply-adds of every dot_general `fn(*args)` runs (fn traced, then interpreted)."""
    closed = jax.make_jaxpr(fn)(*args)
    count = [0]
    _run(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args), count)
    return count[0]


def _run(jaxpr, consts, args, count):
    env = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        outs = _eqn(eqn, [read(v) for v in eqn.invars], count)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _eqn(eqn, ins, count):
    name, p = eqn.primitive.name, eqn.params
    if name in _CALLS:
        sub = p[_CALLS[name]]
        return _run(sub.jaxpr, sub.consts, ins, count)
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, carry = ins[:cn], ins[cn:cn + bn], list(ins[cn + bn:])
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        while bool(_run(cond.jaxpr, cond.consts, cc + carry, count)[0]):
            carry = _run(body.jaxpr, body.consts, bc + carry, count)
        return carry
    if name == "cond":
        branch = p["branches"][int(ins[0])]
        return _run(branch.jaxpr, branch.consts, ins[1:], count)
    if any(hasattr(getattr(v, "jaxpr", v), "eqns") for v in p.values()):
        raise NotImplementedError(f"jaxpr_flops: {name} holds a jaxpr this counter cannot enter")
    if name == "dot_general":
        (contract, _), _ = p["dimension_numbers"]
        out = jax.eval_shape(lambda a, b: eqn.primitive.bind(a, b, **p), *ins)
        count[0] += 2 * math.prod(out.shape) * math.prod(ins[0].shape[d] for d in contract)
    res = eqn.primitive.bind(*ins, **p)
    return res if eqn.primitive.multiple_results else [res]
