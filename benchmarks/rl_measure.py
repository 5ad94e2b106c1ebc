"""The GPU measurements of `minipic-bench rl`:

  --update-timing: `LLM.update_weights` at a model's shape (e.g. the llama3_8b preset, bf16):
    seconds per update, XLA compiles during it (JAX's compile-time events less persistent-cache
    loads: benchmarks/compile_counter.py; 0 expected: the write programs,
    minipic_jax/weights_write.py, are compiled first by `weights_update.prepare`, as LLM's
    warm-up does, and timed apart), and the device memory it adds
    over what was in use before (peak - in use, after an earlier high-water mark is padded away;
    one layer at most expected), with the allocator's in-use and the live arrays after it.
  --rollout-compare: G samples of each of B P-token prompts, N new tokens: the engine
    (`generate_arrays`, n=G, the samples sharing their prompt's blocks) vs a plain jitted
    sampling loop over the same model (benchmarks/dense_sampler.py: dense KV, no sharing), same
    process; each loop's decode step (what a token adds after the prefill) against the
    weight-read floor (weights' bytes / the device copy rate measured in the same process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.compile_counter import CompileCounter
from minipic_jax import LLM, SamplingParams, weights_update
from minipic_jax.loading import load_model


@contextlib.contextmanager
def count_compiles():
    """A one-item list, filled when the block ends: how many XLA backend compiles ran inside it
    (a program loaded from the persistent compilation cache is not one:
    benchmarks/compile_counter.py)."""
    counter, seen = CompileCounter(), [0]
    try:
        yield seen
    finally:
        seen[0] = counter.read()["xla_compiles"]


def _memory(devices) -> tuple:
    """(in-use bytes, peak bytes) of each device."""
    stats = [d.memory_stats() or {} for d in devices]
    return ([st.get("bytes_in_use", 0) for st in stats],
            [st.get("peak_bytes_in_use", 0) for st in stats])


def _live_bytes() -> int:
    """Bytes of the jax arrays alive (what the allocator's in-use should hold, chunks aside;
    a sharded array counts its global size)."""
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _pad_to_peak(devices):
    """On each device an array filling the gap between its in-use bytes and its high-water mark
    (which never comes down: loading the weight sets, say), so the next peak is the measured
    work's own. Made from host memory: no program compiles for it. Returns (the arrays, the
    largest gap)."""
    pads, gaps = [], []
    for device, in_use, peak in zip(devices, *_memory(devices)):
        gap = peak - in_use
        gaps.append(gap)
        if gap <= 0:
            continue
        try:
            pads.append(jax.block_until_ready(jax.device_put(np.zeros(gap, np.uint8), device)))
        except jax.errors.JaxRuntimeError as e:  # no room: the peak below is an upper bound
            print(f"rl_measure: no pad of {gap} bytes on {device} ({e}); the update's peak is "
                  f"at most the earlier high-water mark")
    return pads, max(gaps)


def _write_programs(llm) -> int:
    """Write programs compiled so far (minipic_jax/weights_write.py: the first update's)."""
    writer = llm.weights_version.writer
    return 0 if writer is None else writer.compiles


def _update_row(llm, params) -> dict:
    """One timed update: seconds, compiles, step re-traces, and its memory on the device that
    grew most (under tensor parallelism each of the mesh's): `added_bytes` = the device's peak
    over the in-use bytes before it (the high-water mark raised to in-use first:
    `_pad_to_peak`), `in_use_growth` (what the allocator still holds after it; a best-fit
    allocator's misfit chunks show here) and `live_growth` (the arrays alive)."""
    runner = llm.llm_engine.runner
    devices = _devices(runner)
    pads, gap = _pad_to_peak(devices)
    in_use, _ = _memory(devices)
    live = _live_bytes()
    variants = runner.num_compiles  # step variants traced (a re-trace would add one)
    writes = _write_programs(llm)
    with count_compiles() as compiles:
        t0 = time.perf_counter()
        llm.update_weights(params)
        jax.block_until_ready(runner.params)
        seconds = time.perf_counter() - t0
    in_use_after, peak = _memory(devices)
    row = dict(seconds=seconds, compiles=compiles[0],
               added_bytes=max(max(p - u, 0) for p, u in zip(peak, in_use)),
               step_retraces=runner.num_compiles - variants,
               write_program_compiles=_write_programs(llm) - writes,
               pad_bytes=sum(p.nbytes for p in pads), earlier_peak_bytes=gap,
               in_use_growth=max(a - u for a, u in zip(in_use_after, in_use)),
               live_growth=_live_bytes() - live)
    del pads
    return row


def _devices(runner) -> list:
    return [jax.devices()[0]] if runner.mesh is None else list(runner.mesh.devices.flat)


def _weight_sets(llm, model: str, dtype: str) -> list:
    """Two other weight sets, as a trainer would hand them over: on the device, or under tensor
    parallelism placed by the engine's rules table (what a trainer sharded the same way holds:
    the update takes them without a copy), made in host memory first (no device holds a set
    whole)."""
    runner, loaded = llm.llm_engine.runner, llm.llm_engine.loaded
    if runner.mesh is None:
        return jax.block_until_ready([load_model(model, dtype=dtype, seed=s).params
                                      for s in (1, 2)])
    from serving.step import sharding
    axes = loaded.family.param_axes(loaded.cfg)
    copies = sharding.kv_replication(loaded.cfg, runner.config.tensor_parallel_size)
    sets = []
    for s in (1, 2):
        with jax.default_device(jax.devices("cpu")[0]):
            host = load_model(model, dtype=dtype, seed=s).params
        targets = sharding.source_shardings(host, axes, runner.mesh, copies)
        sets.append(jax.block_until_ready(jax.tree.map(
            lambda x, t: jax.device_put(np.asarray(x), t), host, targets)))  # host slices
        del host
    return sets


def _layer_bytes(runner) -> int:
    """One served layer's bytes on the first device (the whole layer on one device)."""
    first = _devices(runner)[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(runner.params["layers"][0])
               for s in x.addressable_shards if s.device == first)


def update_timing(model: str, dtype: str, repeats: int = 3, **engine_args) -> dict:
    """Seconds, compiles and added device memory of `repeats` updates (two weight sets, taken
    in turn), then a short generate with the last weights (compiles: 0 expected). With
    `tensor_parallel_size` > 1 in `engine_args` the memory is each mesh device's (the largest)
    and one layer means one layer's shards on a device."""
    llm = LLM(model, dtype=dtype, seed=0, **engine_args)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)  # warm
    sets = _weight_sets(llm, model, dtype)
    fused_layer = _layer_bytes(llm.llm_engine.runner)
    t0 = time.perf_counter()  # what LLM(warmup=True) does: the updates then compile nothing
    prepared = weights_update.prepare(llm)
    prepare_s = time.perf_counter() - t0
    print(f"write programs: {prepared} compiled in {prepare_s:.2f} s (weights_update.prepare, "
          f"part of LLM's warm-up; else the first update's)")
    rows = [_update_row(llm, sets[i % 2]) for i in range(repeats)]
    with count_compiles() as compiles:
        llm.generate([[1, 2, 3, 4]], sp, use_tqdm=False)
    out = dict(model=model, dtype=dtype, updates=rows, layer_bytes=fused_layer,
               tensor_parallel_size=llm.config.tensor_parallel_size,
               write_programs_prepared=prepared, prepare_s=prepare_s,
               weights_bytes=sum(x.nbytes for x in jax.tree.leaves(llm.llm_engine.runner.params)),
               generate_compiles_after=compiles[0])
    mib = 2 ** 20
    for r in rows:
        print(f"update_weights: {r['seconds']:.3f} s, {r['compiles']} compiles "
              f"({r['write_program_compiles']} of them write programs), "
              f"{r['step_retraces']} step re-traces, peak +{r['added_bytes'] / mib:.0f} MiB over "
              f"in-use (one layer: {fused_layer / mib:.0f} MiB; an earlier high-water mark "
              f"+{r['earlier_peak_bytes'] / mib:.0f} MiB padded away), in-use after "
              f"{r['in_use_growth'] / mib:+.0f} MiB, live arrays {r['live_growth'] / mib:+.0f} MiB")
    print(f"generate after the updates: {compiles[0]} compiles")
    return out


def _best_of(fn, repeats: int) -> float:
    """Best seconds of `repeats` calls of fn(k) (seeds 1..), after a warm-up call (seed 0)."""
    fn(0)
    best = float("inf")
    for k in range(repeats):
        t0 = time.perf_counter()
        fn(k + 1)
        best = min(best, time.perf_counter() - t0)
    return best


def _weight_read_floor(llm, copy_gb: float) -> dict:
    """A decode step reads every weight once: its floor is the weights' bytes over the device's
    copy rate, measured here as engine_bench measures it."""
    from benchmarks.engine_bench import copy_rate
    rate = copy_rate(copy_gb)
    weights = sum(x.nbytes for x in jax.tree.leaves(llm.llm_engine.runner.params))
    return dict(copy_rate_GBps=rate / 1e9, weights_bytes=weights, floor_ms=weights / rate * 1e3)


def _loop_row(fn, repeats: int, new_tokens: int, rows: int, floor_ms: float) -> dict:
    """Seconds of a whole rollout and of its prefill (one new token); the decode step is what
    the other tokens add, each, against the weight-read floor. A loop out of device memory
    (dense per-sample caches at many rows) gives its error instead."""
    try:
        seconds = _best_of(lambda k: fn(k, new_tokens), repeats)
        prefill = _best_of(lambda k: fn(k, 1), repeats)
    except jax.errors.JaxRuntimeError as e:
        return dict(error=str(e).splitlines()[0][:300])
    step_ms = (seconds - prefill) / max(new_tokens - 1, 1) * 1e3
    return dict(seconds=seconds, output_tokens_per_s=rows * new_tokens / seconds,
                prefill_seconds=prefill, decode_step_ms=step_ms, over_floor=step_ms / floor_ms)


def rollout_compare(model: str, dtype: str, *, prompts: int = 1, samples: int = 8,
                    prompt_len: int = 512, new_tokens: int = 256, repeats: int = 3,
                    copy_gb: float = 4.0, **engine_args) -> dict:
    """G samples of each of B random `prompt_len`-token prompts, `new_tokens` new tokens: the
    engine (`generate_arrays`, n=G) vs the plain loop, best of `repeats` after a warm-up; each
    loop's decode step against the weight-read floor (`_weight_read_floor`)."""
    from benchmarks import dense_sampler
    llm = LLM(model, dtype=dtype, seed=0, **engine_args)
    cfg = llm.llm_engine.loaded.cfg
    rng = np.random.default_rng(0)
    ids = rng.integers(3, min(cfg.vocab_size, 30000), (prompts, prompt_len)).astype(np.int32)
    sp = SamplingParams(temperature=1.0, max_tokens=new_tokens, n=samples, ignore_eos=True)

    def engine_run(k, tokens):
        llm.llm_engine.reset_prefix_cache()  # each run prefills its prompts (once each, shared)
        out = llm.generate_arrays(ids, [prompt_len] * prompts,
                                  dataclasses.replace(sp, seed=k, max_tokens=tokens))
        return jax.block_until_ready(out.tokens)
    params = load_model(model, dtype=dtype, seed=0).params
    fns = dense_sampler.make_sampler(cfg)

    def plain_run(k, tokens):
        return jax.block_until_ready(dense_sampler.sample(
            params, cfg, ids, samples, tokens, seed=k, dtype=jnp.dtype(dtype), fns=fns))
    floor = _weight_read_floor(llm, copy_gb)
    rows = prompts * samples
    out = dict(prompts=prompts, samples=samples, prompt_len=prompt_len, new_tokens=new_tokens,
               **floor)
    for name, fn in (("engine", engine_run), ("plain_loop", plain_run)):
        out[name] = row = _loop_row(fn, repeats, new_tokens, rows, floor["floor_ms"])
        if "error" in row:
            print(f"{name}: {row['error']}")
            continue
        print(f"{name}: Throughput: {prompts / row['seconds']:.2f} requests/s, "
              f"{rows * (prompt_len + new_tokens) / row['seconds']:.1f} total tokens/s, "
              f"{row['output_tokens_per_s']:.1f} output tokens/s; decode step "
              f"{row['decode_step_ms']:.2f} ms = {row['over_floor']:.2f}x the weight-read floor "
              f"({floor['floor_ms']:.2f} ms: {floor['weights_bytes'] / 1e9:.2f} GB at "
              f"{floor['copy_rate_GBps']:.0f} GB/s)")
    if "error" not in out["engine"] and "error" not in out["plain_loop"]:
        out["speedup"] = out["plain_loop"]["seconds"] / out["engine"]["seconds"]
        print(f"engine / plain loop: {out['speedup']:.2f}x (B={prompts} x G={samples}, prompt "
              f"{prompt_len}, {new_tokens} new tokens)")
    return out
