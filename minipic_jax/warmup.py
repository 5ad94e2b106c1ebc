"""The warm-up `LLM()` runs: every step variant a greedy request needs, compiled before the first
request, so no request waits on a compile (issue 29: a hybrid model's span request compiled two
step variants while the user waited, 50 s on an H200).

On a hybrid model it covers the span steps too (LLMEngine.warmup: one span step per token bucket
and plan, capturing maps; one small program per chain-row bucket composing cached ones,
serving/hybrid/span_compose.py). A line on stderr says what compiles and what it cost; the
seconds and variant count land in `LLM.startup` (warmup_s, warmup_variants, warmup_compiled).
A variant met later (another sampling mode, a longer chain of cached spans) still compiles on
first use: `generate`'s bar says so (minipic_jax/batch/progress.Progress).
"""

from __future__ import annotations

import sys
import time

from minipic_jax import weights_update

# LLM(warmup=None) reads this. None: warm up hybrid models (a span request's step variants
# stalled it for tens of seconds) and compile other models' variants on first use (a plain
# model's first request compiles what it meets, and the bar says so). The suite sets False
# (tests/conftest.py): its engines compile only the variants each test meets; tests of the
# warm-up pass warmup=True.
DEFAULT: bool | None = None


def run(llm, show: bool = True) -> dict:
    """Run the engine's default warm-up, telling stderr when `show`; returns its costs."""
    steps = llm.llm_engine.runner._step  # serving/step/step_executables.StepExecutables
    before = dict(steps.counts)

    def tell(done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\rminipic_jax: warm-up: compiling step variant {done}/{total}", end=end,
              file=sys.stderr, flush=True)
    steps.on_compile = tell if show else None
    t0 = time.perf_counter()
    try:
        llm.llm_engine.warmup()
    finally:
        steps.on_compile = None
    # update_weights' write programs too: an RL loop's first update then compiles nothing
    write_programs = weights_update.prepare(llm)
    # last: XLA dropped every step's CUDA graphs when it made those programs; rebuilt here, not
    # on a request's first steps (serving/engine_warmup.py)
    llm.llm_engine.first_calls()
    cost = {"warmup_s": time.perf_counter() - t0,
            "warmup_variants": llm.llm_engine.runner.startup.get("variants", 0),
            "warmup_compiled": steps.counts["compiled"] - before["compiled"],
            "warmup_write_programs": write_programs}
    if show:
        print(f"minipic_jax: warm-up: {cost['warmup_variants']} step variants ready "
              f"({cost['warmup_compiled']} compiled) in {cost['warmup_s']:.1f} s",
              file=sys.stderr, flush=True)
    return cost
