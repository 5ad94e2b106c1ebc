"""The GPU measurements of `minipic-bench rl`:

  --update-timing: `LLM.update_weights` at a model's shape (e.g. the llama3_8b preset, bf16):
    seconds per update, XLA compiles during it (JAX's compile-time events; the first update
    compiles the two write programs, minipic_jax/weights_write.py), and the device memory it adds
    over what was in use before (peak - in use, after an earlier high-water mark is padded away;
    one layer at most expected), with the allocator's in-use and the live arrays after it.
  --rollout-compare: G samples of one P-token prompt, N new tokens: the engine
    (`generate_arrays`, n=G, the samples sharing the prompt's blocks) vs a plain jitted sampling
    loop over the same model (benchmarks/dense_sampler.py: dense KV, no sharing), same process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from minipic_jax import LLM, SamplingParams
from minipic_jax.loading import load_model


@contextlib.contextmanager
def count_compiles():
    """A one-item list: how many XLA backend compiles ran inside the block."""
    seen = [0]

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen[0] += 1
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _memory():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use", 0), stats.get("peak_bytes_in_use", 0)


def _live_bytes() -> int:
    """Bytes of the jax arrays alive (what the allocator's in-use should hold, chunks aside)."""
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _pad_to_peak():
    """An array filling the gap between the device's in-use bytes and its high-water mark (which
    never comes down: loading the weight sets, say), so the next peak is the measured work's own.
    Made from host memory: no program compiles for it. Returns (the array or None, the gap)."""
    in_use, peak = _memory()
    gap = peak - in_use
    if gap <= 0:
        return None, gap
    try:
        return jax.block_until_ready(jax.device_put(np.zeros(gap, np.uint8),
                                                    jax.devices()[0])), gap
    except jax.errors.JaxRuntimeError as e:  # no room for it: the peak below is an upper bound
        print(f"rl_measure: no pad of {gap} bytes ({e}); the update's peak is at most "
              f"the earlier high-water mark")
        return None, gap


def _update_row(llm, params) -> dict:
    """One timed update: seconds, compiles, step re-traces, and its memory: `added_bytes` = the
    device's peak over the in-use bytes before it (the high-water mark raised to in-use first:
    `_pad_to_peak`), `in_use_growth` (what the allocator still holds after it; a best-fit
    allocator's misfit chunks show here) and `live_growth` (the arrays alive)."""
    runner = llm.llm_engine.runner
    pad, gap = _pad_to_peak()
    in_use, _ = _memory()
    live = _live_bytes()
    variants = runner.num_compiles  # step variants traced (a re-trace would add one)
    with count_compiles() as compiles:
        t0 = time.perf_counter()
        llm.update_weights(params)
        jax.block_until_ready(runner.params)
        seconds = time.perf_counter() - t0
    in_use_after, peak = _memory()
    row = dict(seconds=seconds, compiles=compiles[0], added_bytes=max(peak - in_use, 0),
               step_retraces=runner.num_compiles - variants,
               pad_bytes=0 if pad is None else pad.nbytes, earlier_peak_bytes=gap,
               in_use_growth=in_use_after - in_use, live_growth=_live_bytes() - live)
    del pad
    return row


def update_timing(model: str, dtype: str, repeats: int = 3, **engine_args) -> dict:
    """Seconds, compiles and added device memory of `repeats` updates (two weight sets, taken
    in turn), then a short generate with the last weights (compiles: 0 expected)."""
    llm = LLM(model, dtype=dtype, seed=0, **engine_args)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)  # warm
    sets = [load_model(model, dtype=dtype, seed=s).params for s in (1, 2)]
    jax.block_until_ready(sets)
    fused_layer = sum(x.nbytes for x in jax.tree.leaves(llm.llm_engine.runner.params["layers"][0]))
    rows = [_update_row(llm, sets[i % 2]) for i in range(repeats)]
    with count_compiles() as compiles:
        llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)
    out = dict(model=model, dtype=dtype, updates=rows, layer_bytes=fused_layer,
               weights_bytes=sum(x.nbytes for x in jax.tree.leaves(llm.llm_engine.runner.params)),
               generate_compiles_after=compiles[0])
    mib = 2 ** 20
    for r in rows:
        print(f"update_weights: {r['seconds']:.3f} s, {r['compiles']} compiles, "
              f"{r['step_retraces']} step re-traces, peak +{r['added_bytes'] / mib:.0f} MiB over "
              f"in-use (one layer: {fused_layer / mib:.0f} MiB; an earlier high-water mark "
              f"+{r['earlier_peak_bytes'] / mib:.0f} MiB padded away), in-use after "
              f"{r['in_use_growth'] / mib:+.0f} MiB, live arrays {r['live_growth'] / mib:+.0f} MiB")
    print(f"generate after the updates: {compiles[0]} compiles")
    return out


def rollout_compare(model: str, dtype: str, *, samples: int = 8, prompt_len: int = 512,
                    new_tokens: int = 256, repeats: int = 3, **engine_args) -> dict:
    """Output tokens/s of both ways (best of `repeats`, each after a warm-up run)."""
    from benchmarks import dense_sampler
    llm = LLM(model, dtype=dtype, seed=0, **engine_args)
    cfg = llm.llm_engine.loaded.cfg
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, min(cfg.vocab_size, 30000), (1, prompt_len)).astype(np.int32)
    sp = SamplingParams(temperature=1.0, max_tokens=new_tokens, n=samples, ignore_eos=True)

    def engine_run(k):
        llm.llm_engine.reset_prefix_cache()  # each run prefills the prompt (once, shared)
        out = llm.generate_arrays(prompt, [prompt_len], dataclasses.replace(sp, seed=k))
        return jax.block_until_ready(out.tokens)
    params = load_model(model, dtype=dtype, seed=0).params
    fns = dense_sampler.make_sampler(cfg)

    def plain_run(k):
        return jax.block_until_ready(dense_sampler.sample(
            params, cfg, prompt[0].tolist(), samples, new_tokens, seed=k, dtype=jnp.dtype(dtype),
            fns=fns))
    times = {}
    for name, fn in (("engine", engine_run), ("plain_loop", plain_run)):
        fn(0)
        best = float("inf")
        for k in range(repeats):
            t0 = time.perf_counter()
            fn(k + 1)
            best = min(best, time.perf_counter() - t0)
        times[name] = best
    tokens = samples * new_tokens
    out = {name: dict(seconds=s, output_tokens_per_s=tokens / s) for name, s in times.items()}
    out["speedup"] = times["plain_loop"] / times["engine"]
    for name in ("engine", "plain_loop"):
        print(f"{name}: Throughput: {1 / times[name]:.2f} requests/s, "
              f"{(samples * (prompt_len + new_tokens)) / times[name]:.1f} total tokens/s, "
              f"{out[name]['output_tokens_per_s']:.1f} output tokens/s")
    print(f"engine / plain loop: {out['speedup']:.2f}x (G={samples}, prompt {prompt_len}, "
          f"{new_tokens} new tokens)")
    return out
