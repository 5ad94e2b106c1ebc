"""The cached-span TTFT pair of `minipic-bench rag --configs ttft` (issue 28).

One engine (position-free, fcfs), one structured request `[system, Span x n, question]`:
  1. through the engine loop (`drive`): the cold request (every span computed), then `repeats`
     requests with the same spans reordered and new questions (every span a hit); TTFT and the
     engine's step time of each;
  2. through `LLM.generate`, as a user calls it (`Prompt`/`Span` objects in, outputs out): a cold
     call under a fresh cache salt, then `repeats` cached calls; the wall of each call, the
     device wait inside it (the engine's stats), the host time (wall - device wait) and the host
     parts (benchmarks/ttft_host.py's split; with a real step, `output` holds the wait for the
     sampled token);
  3. optionally (--ttft-profile 1) the last cached step replayed alone and profiled, and with
     --ttft-command-buffers compiled with those step_command_buffer settings too and timed in
     this process (benchmarks/step_variants.py).
"""

from __future__ import annotations

import statistics

import numpy as np

from benchmarks import rag_workloads as W
from benchmarks.rag_engine import CONFIGS, build_engine, drive

def run_ttft(opts) -> dict:
    """Cached-span TTFT: the cold request (every span computed), then `repeats` requests holding
    the same spans reordered with new questions (every span a cache hit), max_tokens=1 each."""
    from minipic_jax import SamplingParams
    samples = W.load_musique()
    n, length = opts.ttft_spans, opts.ttft_span_tokens
    llm, result = None, {"config": "ttft", "num_spans": n, "span_tokens": length}
    max_len = -(-(n * (length + 2 * 16) + 512) // 1024) * 1024
    llm, timing = build_engine(opts, CONFIGS["fcfs"][0], max_len, spans=True)
    result.update(timing, max_model_len=max_len)
    enc = W.Encoder(llm.get_tokenizer())
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for r in range(1 + opts.ttft_repeats):
        cold, cached = W.ttft_spans(samples, enc, num_spans=n, span_tokens=length, seed=r)
        req = cold if r == 0 else cached
        ids = llm.to_token_ids(W.segments(req), 0)[0]
        run = drive(llm.llm_engine, [ids], sp, salt="ttft")
        rows.append({"cold": r == 0, "prompt_tokens": run["prompt_tokens"],
                     "cached_prompt_tokens": run["cached_prompt_tokens"],
                     "ttft_ms": 1e3 * run["ttft_s"][0], "steps": run["steps"],
                     "step_ms": 1e3 * run["step_time_s"] / max(run["steps"], 1)})
    if opts.ttft_profile and len(rows) > 1:  # the last cached request's one step, replayed
        result["cached_step_profile"] = _profile_last_step(
            llm.llm_engine, command_buffers=getattr(opts, "ttft_command_buffers", None) or ())
    result["generate"] = generate_calls(llm, samples, enc, sp, n, length, opts.ttft_repeats)
    cached_ttft = float(np.median([x["ttft_ms"] for x in rows[1:]])) if len(rows) > 1 else None
    result.update(rows=rows, cold_ttft_ms=rows[0]["ttft_ms"], cached_ttft_ms=cached_ttft,
                  cached_step_ms=float(np.median([x["step_ms"] for x in rows[1:]]))
                  if len(rows) > 1 else None,
                  cold_over_cached=rows[0]["ttft_ms"] / cached_ttft if cached_ttft else None)
    return result


def generate_calls(llm, samples, enc, sp, n: int, length: int, repeats: int) -> dict:
    """The TTFT request through `LLM.generate` (see the module doc, part 2). The calls use the
    default cache salt, which `drive`'s runs did not fill, so the first call is cold."""
    from benchmarks import ttft_host
    pt = ttft_host.instrument(llm)
    stats = llm.llm_engine.stats
    rows = []
    for r in range(1 + repeats):
        cold, cached = W.ttft_spans(samples, enc, num_spans=n, span_tokens=length, seed=100 + r)
        wait0, steps0 = stats.device_wait, stats.steps
        parts = ttft_host.timed_call(llm, pt, W.segments(cold if r == 0 else cached), sp)
        wait_ms = 1e3 * (stats.device_wait - wait0)
        parts["step_call"] = parts.pop("stub")  # the real step's launch here, not a stub
        rows.append({"cold": r == 0, "generate_ms": parts.pop("wall"), "device_wait_ms": wait_ms,
                     "steps": stats.steps - steps0, "cached_prompt_tokens": int(parts.pop("cached")),
                     # minor page faults and this thread's CPU ms in the call (issue 28: is the
                     # host slow per operation, or waiting for something else than the device?)
                     "page_faults": int(parts.pop("faults")),
                     "thread_cpu_ms": parts.pop("thread_cpu"),
                     "parts_ms": {k: v for k, v in parts.items() if k != "host"}})
        rows[-1]["host_ms"] = rows[-1]["generate_ms"] - wait_ms
    out = {"rows": rows, "cold_ms": rows[0]["generate_ms"]}
    if repeats:
        out["cached_ms"] = statistics.median(x["generate_ms"] for x in rows[1:])
        out["cached_host_ms"] = statistics.median(x["host_ms"] for x in rows[1:])
        out["cold_over_cached"] = out["cold_ms"] / out["cached_ms"]
    return out


def _profile_last_step(engine, repeats: int = 5, command_buffers=()) -> dict:
    """The runner's last step (same inputs, same shapes) replayed alone: its median wall time, a
    profiler summary of its device kernels (benchmarks/timing.profile_kernels) and the op counts
    of its compiled program; a step planned without the decode part (MixedOptions.decode_rows
    False) is replayed with it too (`with_decode_part`, the A/B). Replaying rewrites the same
    K/V rows with the same values. `command_buffers` (step_command_buffer settings): the same
    step compiled with each and timed too (benchmarks/step_variants.py), in `command_buffer_ab`."""
    import dataclasses

    from benchmarks.timing import profile_kernels
    r = engine.runner
    ints, floats, kw = r.last_inputs
    out = _replay(r, ints, floats, kw, repeats, profile_kernels)
    plan = kw.get("attn_options")
    if getattr(plan, "decode_rows", True) is False:
        kw_b = dict(kw, attn_options=dataclasses.replace(plan, decode_rows=True))
        out["with_decode_part"] = _replay(r, ints, floats, kw_b, repeats, profile_kernels)
    if command_buffers:
        from benchmarks import step_variants
        out["command_buffer_ab"] = step_variants.compare(r, ints, floats, kw, command_buffers,
                                                         repeats=repeats)
    return out


def _replay(r, ints, floats, kw, repeats, profile_kernels) -> dict:
    from benchmarks import step_variants
    from benchmarks.timing import blocked_ms
    use_prev = r.config.async_scheduling

    def call():
        return r._dispatch(ints, floats, use_prev, kw)

    alone = blocked_ms(call, repeats)["ms"]
    probe = step_variants.dispatch_probe(r, ints, floats, use_prev, kw, repeats)
    prof = profile_kernels(call, steps=3, top=15)
    prof.pop("lines", None)
    try:  # the ops of the executable the replay ran (compiled or loaded at warm-up)
        args = r._args(ints, floats, use_prev, kw)
        text = r._step._table[r._step._key(args, kw)].as_text()
        hlo = {op: text.count(f" {op}(") for op in ("fusion", "custom-call", "while",
                                                    "conditional", "gather", "scatter")}
        hlo["command_buffers"] = len(step_variants.command_buffer_computations(text))
    except Exception as e:  # noqa: BLE001 - a side figure
        hlo = {"error": repr(e)[:200]}
    return {"step_alone_ms": alone, **probe, "tokens": kw["t"],
            "attn_options": repr(kw.get("attn_options")), "hlo_ops": hlo, **prof}
