"""Request isolation in the KV pool: a page is zeroed on the device when the block manager hands
it out for new content, so a slot its new owner never writes (a pad slot, the tail of its last
block) holds 0, never what the block's previous owner left there.

Why: the GPU attention kernels (mosaic_decode, the Mosaic prefill's `direct_v`) multiply the
softmax weights by whole pages of V; an invalid slot has weight exactly 0, but 0 x NaN = NaN, so
a block freed by a request with non-finite K/V (an f16 overflow) would poison the next owner.

Flow: `BlockManager.allocate` records each block it hands out (`fresh`). At each launch the
runner takes the record (`PageZeroer.fill`): up to `zero_rows(t, s)` ids go in the step's own
`zero_pages` input and the step zeroes them in every page leaf as its first operation
(`zero_pages`, top of ModelRunner._step_body); more than that (a long prompt admitted whole) are
zeroed just before, by a separate call in fixed chunks of CALL_PAGES (one compiled variant,
readied at warm-up). Why each order is safe:
  * the step's own K/V writes come after the zeroing in the same program;
  * a block filled whole by a copy-in (host tier, span store) leaves the record when its copy is
    dispatched (TierSet.move_pages -> BlockManager.filled), so it is never zeroed after it;
  * evicted pages (host tier) and span-store writes are gathered before the launch: they read
    the old content;
  * a block allocated and freed again before its step holds nothing anyone can read (a pending
    block is unregistered on release, a copy-in target by the undo or recovery), so it comes back
    only through allocate (recorded again) and zeroing it is harmless; taken as a copy-in target
    meanwhile, `filled` drops it;
  * async scheduling: the step still in flight comes first on the device (the cache threads
    through both), so its stale writes (a discarded row into its own freed block) land before.

Cost per step: a scatter of zeros of `zero_rows(t, s) = min(s + ceil(t / block_size), 32)` page
rows in each page leaf (K and V of each attention layer): 2 x attention layers small kernels,
not yet timed on a GPU (a decode step's A/B is the first device call to make). Only the fresh
rows are written (padding rows are dropped, an index check each): fresh pages x bytes_per_block
bytes, bytes_per_block = 2 x attention layers x block_size x KV heads x head_dim x itemsize
(Llama-3-8B, bf16, block 16: 2 MiB). A prefill writes those pages anyway; a decode step has
fresh pages only where sequences cross a block boundary (each once per block_size tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention import triton_zero
from kernels_pallas.sharding import tp_mesh
from serving.cache.kv_pool import page_mask


STEP_PAGES = 32  # at most this many page ids ride in a step's own input
# A step's zeroing as one Pallas kernel over every page leaf (paged_attention/triton_zero.py)
# instead of an XLA scatter a leaf (12 kernels a Qwen3.5-0.8B step, 64 a Llama-3-8B one, on a
# GPU, one process without tensor parallelism). Off until timed.
ZERO_KERNEL = False
CALL_PAGES = 128  # page ids per separate call (the rest of a step's fresh pages)


def zero_rows(t: int, s: int, block_size: int) -> int:
    """Length of the `zero_pages` input of a step of t query tokens and s rows: the pages such a
    step can newly reach (one per row crossing a block boundary plus its tokens' blocks), at
    most STEP_PAGES. The scatter runs over every entry of it, dropped padding included, in each
    page leaf of every step: the cap keeps a decode step's fixed cost small (a batch of 256
    sequences crosses ~16 block boundaries a step on average); a prefill step's pages beyond
    it go to separate calls."""
    return min(s + -(-t // block_size), STEP_PAGES)


def zero_pages(cache, ids, num_pages: int, block_size: int, kernel: bool = True):
    """`cache` with pages `ids` [Z] int32 set to 0 in every page leaf (ids >= num_pages are
    padding, dropped). Pure; under tensor parallelism each shard zeroes its heads. With
    ZERO_KERNEL, on a GPU, in a trace with no TP mesh, the page leaves go through one Pallas
    kernel where it takes them (else XLA scatters); kernel=False: never (a caller whose arrays
    may be sharded without a mesh in its trace: `PageZeroer`'s own call)."""
    leaves, treedef = jax.tree.flatten(cache)
    mask = page_mask(cache, num_pages, block_size)
    pages = [x for x, m in zip(leaves, mask) if m]
    if kernel and ZERO_KERNEL and jax.default_backend() == "gpu" and tp_mesh() is None \
            and not triton_zero.takes(pages, block_size):
        zeroed = iter(triton_zero.zero_pages_triton(pages, ids))
        return jax.tree.unflatten(treedef, [next(zeroed) if m else x
                                            for x, m in zip(leaves, mask)])
    out = [x.at[ids].set(jnp.zeros((), x.dtype), mode="drop") if m else x
           for x, m in zip(leaves, mask)]
    return jax.tree.unflatten(treedef, out)


class PageZeroer:
    """The host side: takes the block manager's fresh blocks (`source`, from the engine:
    BlockManager.take_fresh through the cache manager) for each launch."""

    def __init__(self, num_pages: int, config, source=None):
        self.num_pages = num_pages
        self.chunk = CALL_PAGES  # the separate call's ids (one compiled variant)
        self.source = source
        self._zero = jax.jit(functools.partial(zero_pages, num_pages=num_pages,
                                               block_size=config.block_size, kernel=False),
                             donate_argnums=(0,))
        self.num_zeroed = 0  # pages zeroed so far
        self.num_separate = 0  # pages zeroed by separate calls (more than a step's input holds)

    def fill(self, field: np.ndarray, cache):
        """Write this launch's fresh blocks into the step input `field` ([Z] int32, the rest
        num_pages: dropped), after zeroing any beyond Z here first; returns the cache."""
        fresh = self.source() if self.source is not None else []
        n = min(len(fresh), field.size)
        field[:n] = fresh[:n]
        field[n:] = self.num_pages
        for i in range(n, len(fresh), self.chunk):
            cache = self._zero(cache, jnp.asarray(self._ids(fresh[i:i + self.chunk])))
        self.num_zeroed += len(fresh)
        self.num_separate += len(fresh) - n
        return cache

    def _ids(self, blocks) -> np.ndarray:
        ids = np.full(self.chunk, self.num_pages, np.int32)
        ids[:len(blocks)] = blocks
        return ids

    def warmup(self, cache):
        """Compile the separate call (all padding: nothing written); returns the cache."""
        return self._zero(cache, jnp.asarray(self._ids([])))
