"""The engine's warm-up (LLMEngine.warmup): every program a run needs compiled and run once.

On a GPU each step runs as XLA command buffers (CUDA graphs), and XLA drops every program's
graphs whenever it makes a new program (xla/backends/gpu/runtime/command_buffer_thunk.cc), to
rebuild them at the program's next run: 3-6 ms of dispatch for a step on an H100 (benchmarks/
RESULTS.md, session 27). So the programs are compiled first (the span store's page moves, then
the step variants) and all run again last (`first_calls`; minipic_jax/warmup.py calls it once
more after update_weights' write programs), and a request's first steps find their graphs built.
"""

from __future__ import annotations

import gc
import time


def warmup(engine, modes, spans) -> None:
    """Ready the step of each bucket and (all_greedy, use_filter, num_logprobs) mode, so a run
    compiles nothing (ModelRunner.warmup; seconds: runner.startup). spans: a hybrid's span steps
    too (None: on a hybrid model, so a span request, cold or cached, compiles nothing)."""
    runner = engine.runner
    if spans is None:
        spans = runner.hybrid
    t0 = time.perf_counter()
    runner.cache = engine.cache.warmup(runner.cache)  # the span store's page moves
    t1 = time.perf_counter()
    for all_greedy, use_filter, num_logprobs in modes:  # every mode compiled, then all run
        runner.warmup(all_greedy=all_greedy, use_filter=use_filter, num_logprobs=num_logprobs,
                      spans=spans, run=False)
    first_calls(engine)
    t2 = time.perf_counter()
    gc.collect()  # tracing leaves millions of long-lived objects: out of the GC's reach
    gc.freeze()
    runner.startup.update(movers_s=t1 - t0, gc_s=time.perf_counter() - t2)


def first_calls(engine) -> None:
    """The page moves and every warmed step variant run once more, empty (their CUDA graphs
    rebuilt after the last program made: ModelRunner.first_calls)."""
    engine.runner.cache = engine.cache.warmup(engine.runner.cache)
    engine.runner.first_calls()
