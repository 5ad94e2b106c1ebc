"""Sizing the paged KV pool: how many blocks fit, and what one block costs in bytes."""

from __future__ import annotations

import jax
import numpy as np

from serving.config import Config
from serving.offload import page_leaf


def default_num_blocks(config: Config, mcfg, dtype) -> int:
    """Blocks for `Config.num_kv_blocks=None`: gpu_memory_utilization of the device's memory
    limit less what is in use (K and V of every layer per token); without memory stats (CPU),
    enough for max_num_seqs full sequences, at most 4096. Step temporaries are not reserved."""
    per_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * np.dtype(dtype).itemsize
    want = config.max_num_seqs * config.max_blocks_per_seq
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU backends may not report memory
        stats = {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] * config.gpu_memory_utilization - stats.get("bytes_in_use", 0)
        return max(2, int(free // (per_token * config.block_size)))
    return max(2, min(want, 4096))


def kv_bytes_per_block(cache, num_blocks: int, block_size: int) -> int:
    """Bytes of one block across every page-shaped leaf of the cache (for offload accounting)."""
    return sum(x.nbytes for x in jax.tree.leaves(cache) if page_leaf(x, num_blocks, block_size)
               ) // num_blocks
