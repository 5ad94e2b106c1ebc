"""Start-up split for the benchmark reports: `LLM.startup` (backend, weights, engine) and the
runner's (`ModelRunner.startup`: weights placement, KV pool, then warm-up phases: step variants
loaded from the executable store or traced / lowered / compiled / stored, their first calls,
page movers, GC). Seconds."""

from __future__ import annotations


def collect(llm) -> dict:
    """One flat dict of every start-up phase of `llm` (an LLM after warm-up)."""
    runner = llm.llm_engine.runner
    return {**getattr(llm, "startup", {}), **runner.startup}


def line(st: dict) -> str:
    """The split in one line, e.g. for a second start: 'backend 1.1 s, weights 3.0 s, engine
    2.0 s (place 0.4, pool 1.5); warm-up: 15 variants, 15 loaded in 2.1 s, 0 compiled (...)'."""
    g = lambda k: st.get(k, 0.0)  # noqa: E731
    return (f"backend {g('backend_s'):.1f} s, weights {g('weights_s'):.1f} s, engine "
            f"{g('engine_s'):.1f} s (place {g('weights_place_s'):.1f}, pool {g('pool_s'):.1f}); "
            f"warm-up: {st.get('variants', 0)} variants, {st.get('loaded', 0)} loaded in "
            f"{g('load_s'):.1f} s, {st.get('compiled', 0)} compiled (trace {g('trace_s'):.1f}, "
            f"lower {g('lower_s'):.1f}, compile {g('compile_s'):.1f}, store {g('save_s'):.1f}), "
            f"first calls {g('first_calls_s'):.1f} s, page movers {g('movers_s'):.1f} s, "
            f"gc {g('gc_s'):.1f} s")
