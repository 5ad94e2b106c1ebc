"""XLA backend compiles and persistent-cache loads seen through jax.monitoring: the one counter
the benchmarks that report compiles share (engine_bench.py, hybrid_span_request.py,
rl_measure.py).

JAX times its compile-or-load call as "backend_compile_duration", so a program loaded from the
persistent compilation cache fires that event too; counting the event alone calls every cache
load a compile. Compiles are those events less the cache hits."""

from __future__ import annotations

_COMPILE_OR_LOAD = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts from the moment it is made. The listeners are registered once per process (jax has
    no public way to remove an event listener) and keep running totals; each counter remembers
    the totals it started at, so several counters (one per measurement) never interfere."""
    _totals: dict | None = None

    def __init__(self):
        if CompileCounter._totals is None:
            from jax import monitoring
            totals = CompileCounter._totals = {"xla_programs": 0, "xla_cache_loads": 0}

            def on_duration(name, *a, **k):
                if name == _COMPILE_OR_LOAD:
                    totals["xla_programs"] += 1  # compiled or loaded from the cache

            def on_event(name, *a, **k):
                if name == _CACHE_HIT:
                    totals["xla_cache_loads"] += 1
            monitoring.register_event_duration_secs_listener(on_duration)
            monitoring.register_event_listener(on_event)
        self._start = dict(CompileCounter._totals)

    def read(self, llm=None) -> dict:
        """{"xla_compiles", "xla_cache_loads"} since this counter was made; with `llm`, also
        "step_compiles": the step variants that engine compiled or loaded so far (its own
        running count: callers take differences)."""
        totals, start = CompileCounter._totals, self._start
        loads = totals["xla_cache_loads"] - start["xla_cache_loads"]
        out = {"xla_compiles": totals["xla_programs"] - start["xla_programs"] - loads,
               "xla_cache_loads": loads}
        if llm is not None:
            counts = llm.llm_engine.runner._step.counts
            out["step_compiles"] = counts["compiled"] + counts["loaded"]
        return out
