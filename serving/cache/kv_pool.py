"""Sizing the paged KV pool: how many blocks fit, and what one block costs in bytes."""

from __future__ import annotations

import gc

import jax
import numpy as np

from serving.cache.step_temps import step_programs
from serving.cache.xla_limit import blocks_within_limit, exact_limit_options
from serving.config import Config


# Cap the default pool by XLA's limit (xla_limit.py) too? Off for now: the cap shrinks the
# H100 pool at max_model_len 40,960 from 21.1 to ~17.3 GiB (XLA counts the weights twice), and
# sized with the traced temporaries (10.8 GiB there, XLA's own 11.8) it may still leave XLA a
# little to rematerialise; benchmarks/pool_reserve_probe.py --xla-rule is the A/B that decides.
CAP_BY_XLA_LIMIT = False
PAGE_FIELDS = ("k", "v")  # the model contract: a family's cache keeps its KV pages in k and v


def page_leaf(x, num_pages: int, block_size: int) -> bool:
    """Whether an array has a page array's shape ([num_pages, block_size, ...]). The shape
    alone does not make a leaf a page array: use `page_mask` on a cache."""
    return hasattr(x, "shape") and x.ndim >= 2 and x.shape[:2] == (num_pages, block_size)


def page_mask(cache, num_pages: int, block_size: int) -> list[bool]:
    """Per leaf of `jax.tree.leaves(cache)`: whether it is a KV page array, i.e. held under the
    cache's `k` or `v` field with shape [num_pages, block_size, ...]. By field, not by shape
    alone: a recurrent state [slots, Hv, Dk, Dv] has a page array's leading dims whenever
    slots == num_pages and Hv == block_size (e.g. 16 heads, block 16), and page zeroing or a
    tier move would then overwrite sequences' recurrent state."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(cache)[0]:
        field = getattr(path[0], "name", None) if path else None
        out.append(field in PAGE_FIELDS and page_leaf(x, num_pages, block_size))
    return out


def block_bytes(config: Config, mcfg, dtype) -> int:
    """Device bytes of one KV block: K and V of every paged layer (a hybrid model's recurrent
    layers keep no pages); under tensor parallelism each device holds its KV heads only (at
    least one)."""
    heads = max(mcfg.num_kv_heads // config.tensor_parallel_size, 1)
    per_token = 2 * mcfg.num_kv_layers * heads * mcfg.head_dim * np.dtype(dtype).itemsize
    return per_token * config.block_size


def default_num_blocks(config: Config, mcfg, dtype, reserve_bytes: int = 0,
                       programs: tuple = (), traced_blocks: int = 0) -> int:
    """Blocks for `Config.num_kv_blocks=None`: gpu_memory_utilization of the device's memory
    limit less what is in use, less `reserve_bytes` (the engine step's temporaries: size_pool
    passes the largest traced peak of the top token bucket's step variants) and a span store's
    staging memory (kv_store_staging_gb, when kv_store_dir is set); and no more than every step
    program in `programs` (xla_limit.ProgramBytes, traced with a pool of `traced_blocks`;
    size_pool passes them only with CAP_BY_XLA_LIMIT) leaves under XLA's memory limit as
    xla_limit.py reads it from XLA's source. Without memory stats (CPU), enough for
    max_num_seqs full sequences, at most 4096."""
    per_block = block_bytes(config, mcfg, dtype)
    want = config.max_num_seqs * config.max_blocks_per_seq
    gc.collect()  # an engine dropped earlier (jitted methods make cycles) still holds its pool
    stats = device_memory()
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] * config.gpu_memory_utilization - stats.get("bytes_in_use", 0)
        free -= reserve_bytes
        if config.kv_store.dir is not None:
            free -= staging_bytes(config)
        blocks = int(free // per_block)
        for prog in programs:
            blocks = min(blocks, blocks_within_limit(stats["bytes_limit"], prog, traced_blocks,
                                                     per_block))
        return max(2, blocks)
    return max(2, min(want, 4096))


def check_default_pool(config: Config, num_blocks: int, reserve: int, per_block: int) -> None:
    """A default pool sized from device memory must hold one sequence of max_model_len (as
    vLLM asks of its KV cache at start): else a ValueError at start with the figures it came
    from, not an engine whose long requests fail one by one."""
    stats = device_memory()
    need = config.max_blocks_per_seq
    if "bytes_limit" not in stats or num_blocks >= need:
        return
    gib = 1 << 30
    raise ValueError(
        f"the default KV pool came to {num_blocks} blocks of {config.block_size} tokens "
        f"({per_block} bytes each), fewer than the {need} one sequence of max_model_len "
        f"{config.max_model_len} needs: device memory limit {stats['bytes_limit'] / gib:.2f} GiB "
        f"x gpu_memory_utilization {config.gpu_memory_utilization}, in use "
        f"{stats.get('bytes_in_use', 0) / gib:.2f} GiB, the step's temporaries "
        f"{reserve / gib:.2f} GiB; lower max_model_len or max_num_batched_tokens, raise "
        f"gpu_memory_utilization, or set num_kv_blocks")


def staging_bytes(config: Config) -> int:
    """The span store's staging memory in bytes: `Config.kv_store.staging_gb`, or (None)
    min(16 GiB, 16% of the device's memory limit), 4 GiB where the backend reports no limit."""
    if config.kv_store.staging_gb is not None:
        return int(config.kv_store.staging_gb * (1 << 30))
    limit = device_memory().get("bytes_limit")
    return min(16 << 30, int(0.16 * limit)) if limit else 4 << 30


def device_memory() -> dict:
    """The first local device's allocator figures (bytes_limit: the pool XLA got, which is
    small when another process holds the device; bytes_in_use; peak_bytes_in_use), {} where
    the backend reports none (CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU backends may not report memory
        return {}
    return {k: int(stats[k]) for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use",
                                       "largest_alloc_size") if k in stats}


def kv_bytes_per_block(cache, num_blocks: int, block_size: int) -> int:
    """Bytes of one block across every page-shaped leaf of the cache (for offload accounting)."""
    mask = page_mask(cache, num_blocks, block_size)
    return sum(x.nbytes for x, m in zip(jax.tree.leaves(cache), mask) if m) // num_blocks


def allocate_pool(make_cache, num_blocks: int, *, may_shrink: bool):
    """(cache, num_blocks): make_cache(n) allocated and waited for. A default-sized pool
    (may_shrink) that does not fit shrinks by 10% until it does: free memory is not one piece
    (with XLA_PYTHON_CLIENT_PREALLOCATE=false the allocator grows in regions; on the H200 the
    4th of 4 arrays of 21 GiB failed with 45 GB free), and an async allocation failure would
    otherwise surface only in the first step. An explicit num_kv_blocks that does not fit is a
    ValueError naming it."""
    while True:
        try:
            cache = make_cache(num_blocks)
            jax.block_until_ready(cache)
            return cache, num_blocks
        except jax.errors.JaxRuntimeError as e:  # what was allocated is freed with `e`
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            if not may_shrink or num_blocks <= 2:
                raise ValueError(f"KV pool of {num_blocks} blocks does not fit in device memory "
                                 f"({str(e).splitlines()[0]}); lower Config.num_kv_blocks or "
                                 f"gpu_memory_utilization") from e
            num_blocks = max(2, int(num_blocks * 0.9))


def size_pool(runner, make_cache, num_blocks: int, mcfg, *, step):
    """(cache, num_blocks, step reserve bytes) of a ModelRunner whose step is set up: an
    explicit `Config.num_kv_blocks` as given (a ValueError when it does not fit); a default one
    sized again now that the weights are placed (fused or sharded), less the step's
    temporaries (step_temps.step_programs with `step`, the runner's (args of, body)
    functions, traced over an abstract pool of `num_blocks`: about a second per variant at the
    8B shape; only where the device reports a memory limit and without tensor parallelism; with
    CAP_BY_XLA_LIMIT also within XLA's limit for each), then shrunk by allocate_pool until it
    fits. The traced programs stay on the runner (`step_programs`, `traced_blocks`); with
    Config.compilation.xla_memory_limit "exact" they are traced for an explicit pool too and
    set the step's XLA memory limit (xla_limit.exact_limit_options, at the pool's final size)."""
    config, reserve, programs = runner.config, 0, ()
    exact = config.compilation.xla_memory_limit == "exact"
    if (config.num_kv_blocks is None or exact) and runner.mesh is None \
            and "bytes_limit" in device_memory():
        runner.cache = jax.eval_shape(lambda: make_cache(num_blocks))  # traced only
        programs = tuple(step_programs(runner, *step, runner._step.donate_argnums))
        runner.step_programs = programs  # the probe (benchmarks/pool_reserve_probe.py) reads them
        runner.traced_blocks = num_blocks
    if config.num_kv_blocks is None:
        reserve = max((p.temp for p in programs), default=0)
        num_blocks = default_num_blocks(config, mcfg, runner.cache_dtype, reserve,
                                        programs if CAP_BY_XLA_LIMIT else (), num_blocks)
        runner.num_blocks = num_blocks
    cache, num_blocks = allocate_pool(make_cache, num_blocks,
                                      may_shrink=config.num_kv_blocks is None)
    if config.num_kv_blocks is None:
        check_default_pool(config, num_blocks, reserve,
                           block_bytes(config, mcfg, runner.cache_dtype))
    if exact and programs:
        extra = (num_blocks - runner.traced_blocks) * kv_bytes_per_block(
            cache, num_blocks, config.block_size)
        runner._step.add_compiler_options(exact_limit_options(
            device_memory()["bytes_limit"], programs, extra))
    return cache, num_blocks, reserve
