"""What checkpoint extraction + restore cost a hybrid engine's step (`hybrid-cache --cost`).

With prefix caching on, a hybrid engine compiles every prefill step with the checkpoint pool:
restore rows are gathered from the pool and written into their seats before the model runs, the
GDN kernel emits the state at each row's `checkpoint_at`, and those states are scattered into the
pool after. Shapes are static, so that work is in every prefill step whether a row restores or
checkpoints or not; its cost is the difference between two programs over the same inputs:

  pool   the step as the engine ran it (a real captured prefill step of the largest token bucket,
         with restores and checkpoints in it when the run had one);
  plain  the same step compiled without the pool (the plain forward: what a hybrid engine with
         prefix caching off runs).

Timed interleaved (pool, plain, pool, ...) on the device, median of `reps` after warm-up. Also
timed alone: the restore (gather S rows from the pool + write them into the seats) and the store
(scatter S states into the pool), as small jitted programs. The pool-less step is compiled in a
thread while the engine warms up (`start_plain_compile`), so it costs no extra wall time when
the persistent compilation cache is on. Host-tier moves (cpu_offload_gb) are not in the runs.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.hybrid import checkpoint_pool
from serving.step.step_inputs import layout as _layout


class StepCapture:
    """Records the prefill step of the largest bucket with the most restore + checkpoint rows."""

    def __init__(self, runner):
        self.runner, self.best, self.score = runner, None, -1
        self.top = runner.config.token_buckets[-1]
        self._orig = runner._dispatch
        runner._dispatch = self._dispatch
        # the captured ints are replayed without the device tables: steps carry their rows
        runner.dev_tables.set(False)

    def _dispatch(self, ints, floats, use_prev, kw):
        if kw.get("t") == self.top and not kw.get("decode_only") and not kw.get("spans"):
            spec, _ = _layout(kw["t"], kw["s"], self.runner.nb, True,
                              block_size=self.runner.block_size)
            rows = [ints[o:o + int(np.prod(shape))] for name, (o, shape) in spec.items()
                    if name in ("ck_slot", "restore_slot")]
            score = sum(int((r >= 0).sum()) for r in rows)
            if score > self.score:
                self.best = (ints.copy(), floats.copy(), dict(kw), use_prev)
                self.score = score
        return self._orig(ints, floats, use_prev, kw)

    def close(self):
        self.runner._dispatch = self._orig
        self.runner.dev_tables.set(True)


def start_plain_compile(runner) -> threading.Thread:
    """Lower the pool-less step of the largest bucket now, compile it in a thread (into the
    persistent compilation cache; the later jitted call reads it from there)."""
    t = runner.config.token_buckets[-1]
    s = runner.config.seq_bucket(t)
    _, size = _layout(t, s, runner.nb, False, block_size=runner.block_size)
    prev = runner._prev() if runner.config.async_scheduling else None
    plans = {runner._plan(t, s, n, d)  # as ModelRunner.warmup
             for n, d in ((0, 1), (min(s, t // 2), 1), (1, 0))}
    lowered = [runner._step.lower(runner.params, runner.cache, np.zeros(size, np.int32),
                                  np.ones(2 * s, np.float32), prev, None, None, t=t, s=s,
                                  all_greedy=True, use_filter=False, num_logprobs=0,
                                  decode_only=False, attn_options=plan) for plan in plans]
    th = threading.Thread(target=lambda: [low.compile() for low in lowered], daemon=True)
    th.start()
    return th


def _plain_ints(ints_ck, t, s, nb, bs):
    spec_ck, _ = _layout(t, s, nb, True, block_size=bs)
    spec, size = _layout(t, s, nb, False, block_size=bs)
    out = np.zeros(size, np.int32)
    for name, (o, shape) in spec.items():
        n, o2 = int(np.prod(shape)), spec_ck[name][0]
        out[o:o + n] = ints_ck[o2:o2 + n]
    return out


def _timer(fn, reps: int):
    fn()
    fn()  # compile / load, then warm
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(runner, family, capture: StepCapture, reps: int = 20) -> dict:
    """Interleaved medians (ms) of the captured step with and without the pool, and of the
    restore and store parts alone. Leaves the engine's cache content undefined (reset after)."""
    if capture.best is None:
        return {"error": "no prefill step of the largest bucket was captured"}
    ints, floats, kw, use_prev = capture.best
    t, s = kw["t"], kw["s"]
    plain = _plain_ints(ints, t, s, runner.nb, runner.block_size)

    def step(pool_on: bool):
        prev = runner._prev() if use_prev else None
        cache, packed, prev, pool = runner._step(
            runner.params, runner.cache, ints if pool_on else plain, floats, prev,
            runner.ck_pool if pool_on else None, None, **kw)[:4]
        runner.cache = cache
        if pool_on:
            runner.ck_pool = pool
        if use_prev:
            runner.prev_tokens = prev
        jax.block_until_ready(packed)

    step(True), step(False), step(True), step(False)  # compiled / loaded, then warm
    a, b = [], []
    for _ in range(reps):
        for pool_on, acc in ((True, a), (False, b)):
            t0 = time.perf_counter()
            step(pool_on)
            acc.append(time.perf_counter() - t0)
    pool = runner.ck_pool
    seats = np.arange(s, dtype=np.int32) % max(runner.scratch_slot, 1)
    idx = jnp.asarray(np.arange(s, dtype=np.int32) % pool.slots)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def restore(states, pool, idx):  # the cache's recurrent states only (no KV pages copied)
        conv, delta = checkpoint_pool.rows(pool, idx)
        return family.write_states(states, jnp.asarray(seats), conv, delta, idx >= 0)

    def run_restore():
        out = restore(dataclasses.replace(runner.cache, k=(), v=()), runner.ck_pool, idx)
        runner.cache = dataclasses.replace(runner.cache, conv=out.conv, delta=out.delta)
        jax.block_until_ready(out)

    conv, delta = checkpoint_pool.rows(pool, idx)
    store = jax.jit(checkpoint_pool.store_rows, donate_argnums=(0,))

    def run_store():
        runner.ck_pool = store(runner.ck_pool, idx, conv, delta)
        jax.block_until_ready(runner.ck_pool)

    ms = lambda xs: 1e3 * float(np.median(xs))  # noqa: E731
    with_pool, without = ms(a), ms(b)
    spec, _ = _layout(t, s, runner.nb, True, block_size=runner.block_size)
    active = {name: int((ints[o:o + int(np.prod(shape))] >= 0).sum())
              for name, (o, shape) in spec.items() if name in ("ck_slot", "restore_slot")}
    return dict(tokens=t, seqs=s, reps=reps, step_ms_pool=with_pool, step_ms_plain=without,
                step_ms_pool_all=[1e3 * x for x in a], step_ms_plain_all=[1e3 * x for x in b],
                overhead=(with_pool - without) / without, rows_checkpointing=active["ck_slot"],
                rows_restoring=active["restore_slot"],
                restore_ms=ms(_timer(run_restore, reps)), store_ms=ms(_timer(run_store, reps)),
                checkpoint_bytes=checkpoint_pool.checkpoint_nbytes(
                    (pool.conv.shape[0], pool.conv.shape[2:], pool.conv.dtype,
                     pool.delta.shape[2:])))
