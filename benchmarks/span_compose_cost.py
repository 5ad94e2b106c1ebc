"""What composing cached span maps costs a hybrid engine's warm span step (`rag --compose-cost 1`).

Before a warm span step, a program of its own (serving/hybrid/span_compose.py) moves each sequence
that skips cached spans on by their affine maps (serving/hybrid/span_maps.entry_states: per chain
position one gather from the map pool and one batched float32 matmul over every GDN layer and
head); the step then runs the model. The composition is timed alone (read the states, compose,
not written back), on the engine's own cache and map pool, next to the step it precedes:

  step      the warm step after the compose call with the most cached maps the run took,
            replayed alone (same inputs; the replay rewrites the same states and maps), median
            of `reps`;
  compose   that step's composition alone (read the chained rows' states, compose; jitted,
            median), and the same for synthetic chains of 1, 4 and 16 maps on every chain row,
            whose slope is the cost of one more map per row.

cost per span = slope / rows / step (a span skipped by one sequence: one map on one row).
plan: the map applications and GFLOP the composition runs (serving/hybrid/chain_compose.py),
against the loop before it (every chain row up to the longest chain). forms: the captured chains
composed by each form of chain_compose.IMPLS in the same process (on a GPU "auto" is the Triton
chain kernel, "xla" the per-position loop it replaced). precisions: the captured chains composed
under each Config.span_maps.compose_precision (ms, share of the step, TFLOP/s, relative
difference of the entry states from IEEE float32's), the difference measured on probe maps:
the captured ones' A are exactly 0 on the random-weight presets (their decay, exp(g) ~ 0.03 a
token, underflows over a 128-token span), so A S is 0 and every precision gives the same bits
on them (`a_zero`: the share of the captured maps' A entries that are 0). The Triton kernel
starts each head's chain at its last map whose A is zero (chain_compose.reset_starts;
`reset_skipped`: the share of (map, layer, head) applications that saves), so on those presets
a chain costs one map: `probe_compose_ms` times the same chains on the probe maps (no zero
head), the cost where a trained model's decays leave every head's A nonzero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import time_calls
from kernels_pallas.gated_delta import affine
from serving.hybrid import chain_compose, span_compose, span_maps


class WarmStepCapture:
    """Keeps the compose call with the most cached maps, and the warm span step after it."""

    def __init__(self, runner):
        self.runner, self.best, self.maps, self.steps = runner, None, -1, 0
        self.program = None
        self._pending = None  # a compose call whose step comes next
        self._orig = runner._dispatch
        runner._dispatch = self._dispatch

    def _dispatch(self, ints, floats, use_prev, kw):
        if kw.get("compose"):
            self.steps += 1
            f = _fields(self.runner, ints, kw)
            n = int((f["chain"] >= 0).sum())
            if n > self.maps:
                self._pending, self.maps = f, n
                self.program = (ints.copy(), dict(kw))  # the engine's compose call itself
        elif self._pending is not None:
            self.best = (ints.copy(), floats.copy(), dict(kw), use_prev, self._pending)
            self._pending = None
        return self._orig(ints, floats, use_prev, kw)

    def close(self):
        self.runner._dispatch = self._orig


def _fields(runner, ints, kw):
    """The compose call's fields, copied: the composer refills the same buffer every step
    (span_compose.ComposeInputs), so views would hold the last call's chains at `measure`."""
    spec, _ = span_compose.layout(*kw["compose"], runner.ck_pool is not None)
    return {k: np.array(ints[o:o + int(np.prod(shape))]).reshape(shape)
            for k, (o, shape) in spec.items()}


FORMS = ("triton", "xla")  # chain_compose.IMPLS timed side by side ("auto" is one of them)


def tflops(gflop: float, ms: float) -> float:
    """TFLOP/s of `gflop` GFLOP done in `ms` milliseconds (GFLOP per ms is TFLOP/s)."""
    return gflop / ms


def probe_pool(pool, chains, seed: int = 0):
    """(pool, chains) holding only the maps `chains` name, with A replaced by a seeded random
    [Dk, Dk] of norm ~1 per column (B, tails, counts kept): maps whose products every precision
    rounds differently, unlike the random presets' A = 0."""
    used = np.unique(chains[chains >= 0])
    ids = jnp.asarray(used, jnp.int32)
    remap = np.full(int(pool.a.shape[0]), -1, np.int32)
    remap[used] = np.arange(used.size, dtype=np.int32)
    dk = pool.a.shape[-1]
    a = jax.random.normal(jax.random.key(seed), (used.size,) + pool.a.shape[1:], jnp.float32)
    probe = span_maps.pool_of(a=a / np.sqrt(dk), b=pool.b[ids], tail=pool.tail[ids],
                              count=pool.count[ids])
    return probe, np.where(chains >= 0, remap[np.clip(chains, 0, None)], -1).astype(np.int32)


def _median_ms(fn, reps):
    """Median ms of one call waited for, after two warm-up calls."""
    return 1e3 * time_calls(fn, iters=1, reps=reps)


def _plan(pool, chains) -> dict:
    """What composing these chains costs (serving/hybrid/chain_compose.py): maps held, map
    applications run now and by the loop before it (every row up to the longest chain), GFLOP."""
    lengths = [int(n) for n in (chains >= 0).cumprod(axis=1).sum(axis=1) if n]
    rows = chains.shape[0]
    _, lg, hv, dk, _ = pool.a.shape
    per = chain_compose.flops_per_application(lg, hv, dk, pool.b.shape[-1])
    now = chain_compose.applications(lengths, rows)
    return dict(maps=sum(lengths), applications=now,
                applications_before=rows * max(lengths, default=0),
                gflop_per_application=per / 1e9, gflop=now * per / 1e9)


def measure(engine, capture: WarmStepCapture, reps: int = 10) -> dict:
    """The figures of the module doc (ms), from the captured step; the captured chains also
    under every composition precision (affine.COMPOSE_PRECISIONS): time, TFLOP/s and the
    relative difference of the entry states from IEEE float32's."""
    if capture.best is None:
        return {"error": "no warm span step (with cached maps) was captured"}
    runner, family = engine.runner, engine.runner.family
    ints, floats, kw, use_prev, f = capture.best
    step_ms = _median_ms(lambda: runner._dispatch(ints, floats, use_prev, kw), reps)

    @functools.partial(jax.jit, static_argnames=("precision", "impl"))
    def compose(cache, pool, slots, chains, precision, impl="auto"):
        conv0, delta0 = family.read_states(cache, slots)
        return span_maps.entry_states(pool, chains, conv0, delta0,
                                      precision=affine.compose_precision(precision), impl=impl)

    def timed(chains, precision=runner.composer.precision, impl="auto", pool=None):
        args = [jnp.asarray(x) for x in (f["slot"], chains)]
        pool = runner.span_pool if pool is None else pool
        return _median_ms(lambda: compose(runner.cache, pool, *args, precision, impl), reps)

    chains = f["chain"]
    rows, length = chains.shape
    slots = runner.span_pool.a.shape[0]
    synth = {}
    for n in (1, 4, 16):  # every row chains n maps (slots cycled), a shape of its own
        c = np.full((rows, max(n, length)), -1, np.int32)
        c[:, :n] = np.arange(rows * n, dtype=np.int32).reshape(rows, n) % slots
        synth[n] = timed(c)
    per_map = (synth[16] - synth[1]) / 15  # one more map on every row
    compose_ms = timed(chains)
    probe, probe_chains = probe_pool(runner.span_pool, chains)  # no zero heads: no reset starts
    probe_ms = timed(probe_chains, pool=probe)
    plan = _plan(runner.span_pool, chains)
    program = {}
    if capture.program is not None:  # off a GPU once over (the figures mean nothing there)
        gpu = jax.default_backend() == "gpu"
        program["pipelined"] = pipelined(runner, capture, reps if gpu else 2, 8 if gpu else 1)
    if jax.default_backend() == "gpu":  # the engine's compose program replayed, kernel by kernel
        from benchmarks.timing import profile_kernels
        c_ints, c_kw = capture.program

        def call():  # its output is the cache (waited for), not the step's packed tokens
            runner._dispatch(c_ints, None, False, c_kw)
            return runner.cache
        # (update: the pipelined figure above stays; assigned anew it was dropped on a GPU)
        program.update(ms=_median_ms(call, reps), profile=profile_kernels(call, top=10))
        from benchmarks.program_forms import program_form
        other = int(not span_maps.COMPOSE_IN_PLACE)  # the engine's form above, the other here
        with program_form(f"COMPOSE_IN_PLACE={other}", runner):
            program["other_form"] = dict(in_place=bool(other), ms=_median_ms(call, reps),
                                         profile=profile_kernels(call, top=3))
        program["in_place"] = not other
    return dict(program=program, tokens=kw["t"], seqs=kw["s"], chain_shape=[rows, length],
                chain_rows=int((f["chain"] >= 0).any(axis=1).sum()), maps_in_step=capture.maps,
                warm_steps=capture.steps, reps=reps, step_ms=step_ms, compose_ms=compose_ms,
                compose_share=compose_ms / step_ms, probe_compose_ms=probe_ms,
                reset_skipped=_reset_skipped(runner.span_pool, chains), synthetic_compose_ms=synth,
                per_map_all_rows_ms=per_map, per_span_ms=per_map / rows,
                per_span_share=per_map / rows / step_ms, plan=plan,
                forms={impl: timed(chains, impl=impl) for impl in FORMS},
                a_zero=_a_zero(runner.span_pool, chains),
                precisions=_precisions(compose, timed, runner, f, (probe, probe_chains), plan,
                                       step_ms),
                map_bytes=int(runner.span_pool.a[0].nbytes + runner.span_pool.b[0].nbytes))


def pipelined(runner, capture, reps: int, iters: int = 8) -> dict:
    """What the compose program adds to its step as the engine runs them (dispatched ahead, one
    wait per `iters` pairs, ABBA against the step alone: benchmarks.timing.ab_time): its launches
    overlap the device's work, so this is its device cost, not the replay-and-wait time above."""
    from benchmarks.timing import ab_time
    ints, floats, kw, use_prev, _ = capture.best
    c_ints, c_kw = capture.program

    def step():
        return runner._dispatch(ints, floats, use_prev, kw)

    def pair():
        runner._dispatch(c_ints, None, False, c_kw)
        return runner._dispatch(ints, floats, use_prev, kw)
    step_ms, pair_ms, ratio, lo, hi = ab_time(step, pair, iters=iters, reps=reps)
    return dict(step_ms=step_ms, pair_ms=pair_ms, compose_ms=pair_ms - step_ms,
                share=ratio - 1, share_iqr=[lo - 1, hi - 1], iters=iters)


def _reset_skipped(pool, chains) -> float:
    """The share of the chains' (map, layer, head) A S dots the reset starts skip
    (chain_compose.reset_starts: a head starts from the B of its last map whose A is zero)."""
    c = jnp.asarray(chains)
    n = span_maps.chain_lengths(c)
    start = chain_compose.reset_starts(pool.zero_a, c, n)  # [S, Lg, Hv]
    total = float(jnp.sum(n)) * start[0].size
    return float(jnp.sum(jnp.where(start >= 0, start + 1, 0))) / total if total else 0.0


def _a_zero(pool, chains) -> float:
    """The share of the chained maps' A entries that are exactly 0."""
    ids = jnp.asarray(np.unique(chains[chains >= 0]), jnp.int32)
    return float(jnp.mean(pool.a[ids] == 0)) if ids.size else 0.0


def _precisions(compose, timed, runner, f, probed, plan, step_ms) -> dict:
    """name -> ms, share of the step, TFLOP/s (captured chains) and rel. difference from
    "highest" of the entry states (the same chains on `probe_pool`'s maps: probed, its
    (pool, chains))."""
    pool, chains = probed
    args = [jnp.asarray(x) for x in (f["slot"], chains)]
    exact = np.asarray(compose(runner.cache, pool, *args, "highest")[1], np.float64)
    out = {}
    for name in affine.COMPOSE_PRECISIONS:
        ms = timed(f["chain"], name)
        got = np.asarray(compose(runner.cache, pool, *args, name)[1], np.float64)
        rel = float(np.linalg.norm(got - exact) / max(np.linalg.norm(exact), 1e-30))
        out[name] = dict(ms=ms, share=ms / step_ms, tflops=tflops(plan["gflop"], ms),
                         rel_vs_highest=rel)
    return out


def report(res: dict) -> str:
    """The summary line, then the plan and one line per composition precision."""
    if "error" in res:
        return f"compose cost: {res['error']}"
    p = res["plan"]
    lines = [
        f"compose cost ({res['tokens']}-token warm step, {res['maps_in_step']} cached maps on "
        f"{res['chain_rows']} rows, chain shape {res['chain_shape']}): step "
        f"{res['step_ms']:.2f} ms, its composition {res['compose_ms']:.3f} ms = "
        f"{res['compose_share']:.2%} (the reset starts skip {res['reset_skipped']:.1%} of the "
        f"head dots; on probe maps, no zero A: {res['probe_compose_ms']:.3f} ms = "
        f"{res['probe_compose_ms'] / res['step_ms']:.2%}); one span on one row "
        f"{res['per_span_ms']:.3f} ms = "
        f"{res['per_span_share']:.3%} of the step (synthetic 1/4/16 maps x "
        f"{res['chain_shape'][0]} rows: " + " / ".join(
            f"{v:.3f}" for v in res["synthetic_compose_ms"].values()) + " ms)",
        f"compose plan: {p['maps']} maps, {p['applications']} applications (the loop before: "
        f"{p['applications_before']}), {p['gflop']:.3f} GFLOP "
        f"({p['gflop_per_application']:.3f} each)",
        "compose form | ms | share of step | TFLOP/s  (the engine's precision; triton: the chain "
        "kernel, 'auto' once AUTO_KERNEL is on; xla: the per-position loop, today's 'auto')"]
    lines += [f"compose form {impl:5s} | {ms:.3f} | {ms / res['step_ms']:.2%} | "
              f"{tflops(p['gflop'], ms):.2f}" for impl, ms in res["forms"].items()]
    lines += [f"compose precision | ms | share of step | TFLOP/s | rel. diff. from highest "
              f"(probe maps; the captured maps' A are {res['a_zero']:.1%} zeros)"]
    lines += [f"compose {name:9s} | {v['ms']:.3f} | {v['share']:.2%} | {v['tflops']:.2f} | "
              f"{v['rel_vs_highest']:.2e}" for name, v in res["precisions"].items()]
    prog = res.get("program") or {}
    pipe = prog.get("pipelined")
    if pipe:
        lines += [f"compose program pipelined: step + compose {pipe['pair_ms']:.3f} ms against the "
                  f"step alone {pipe['step_ms']:.3f} ms = +{pipe['share']:.2%} (IQR "
                  f"{pipe['share_iqr'][0]:+.2%} .. {pipe['share_iqr'][1]:+.2%}; {pipe['iters']} "
                  f"pairs dispatched, one wait)"]
    if prog.get("profile"):  # the engine's own compose program, replayed
        prof, ms = res["program"]["profile"], res["program"]["ms"]
        form = {True: "in place", False: "read-compose-write"}
        lines += [f"compose program {ms:.3f} ms = {ms / res['step_ms']:.2%} of the step: "
                  f"{prof['kernels_per_step']:.0f} "
                  f"kernels, busy {prof['kernel_busy_ms_per_step']:.3f} ms, first-to-last "
                  f"{prof['first_to_last_kernel_ms_per_step']:.3f} ms"
                  + (f" ({form[res['program']['in_place']]})" if "in_place" in res["program"]
                     else "")]
        lines += [f"compose program | {k['ms_per_step']:.3f} ms | {k['calls_per_step']:.0f} | "
                  f"{k['name'][:60]}" for k in prof["top"]]
        if "other_form" in res["program"]:
            o = res["program"]["other_form"]
            in_place_ms, read_write_ms = (o["ms"], ms) if o["in_place"] else (ms, o["ms"])
            lines += [f"compose program {form[o['in_place']]} (COMPOSE_IN_PLACE="
                      f"{int(o['in_place'])}, same process) {o['ms']:.3f} ms = "
                      f"{o['ms'] / res['step_ms']:.2%}: {o['profile']['kernels_per_step']:.0f} "
                      f"kernels, busy {o['profile']['kernel_busy_ms_per_step']:.3f} ms; in place "
                      f"{in_place_ms / read_write_ms:.2f}x read-compose-write"]
    return "\n".join(lines)
