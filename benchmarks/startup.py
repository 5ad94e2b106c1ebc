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


def compare(path: str) -> int:
    """Print one row per configuration of a rag_bench.json (e.g. `--configs fcfs fcfs`: a cold
    then a second start): load, warm-up, their sum, the warm-up split, compiles while timed, and
    whether each run's outputs equal the first run's of the same configuration."""
    import json
    import pathlib
    results = json.loads(pathlib.Path(path).read_text())["results"]
    first: dict = {}
    print(f"{'config':8s} {'load':>6s} {'warm':>6s} {'total':>6s} {'loaded':>6s} {'compiled':>8s} "
          f"{'exe load':>8s} {'trace+lower':>11s} {'compile':>7s} {'first':>6s} "
          f"{'run compiles':>12s} same outputs")
    for res in results:
        if "error" in res:
            print(f"{res['config']:8s} FAILED: {res['error']}")
            continue
        st = res.get("startup", {})
        outs = [r["outputs"] for r in res.get("runs", [])]
        ref = first.setdefault(res["config"], outs)
        same = all(a == b for a, b in zip(outs, ref)) and len(outs) == len(ref)
        run_compiles = sum(r["compiles_during_run"] for r in res.get("runs", []))
        print(f"{res['config']:8s} {res['load_s']:6.1f} {res['warmup_s']:6.1f} "
              f"{res['load_s'] + res['warmup_s']:6.1f} {st.get('loaded', 0):6d} "
              f"{st.get('compiled', 0):8d} {st.get('load_s', 0):8.1f} "
              f"{st.get('trace_s', 0) + st.get('lower_s', 0):11.1f} {st.get('compile_s', 0):7.1f} "
              f"{st.get('first_calls_s', 0):6.1f} {run_compiles:12d} {same}")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(compare(sys.argv[1]))
