"""The static facts of a paged-attention call that decide which kernel can run it and how.

Built from the arrays by `paged_attention` (`Problem.of`), or from a model's config by the engine
(which picks its kernels once, at start), so both ask the registry the same question.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Largest position bound for which the decode kernels read key cos | sin from a [max_position, R]
# table by default (instead of computing them per key): the table should stay small enough to
# live in L2 (table lookups: 5.8% faster engine decode step than per-key trig;
# benchmarks/history/engine.md).
TABLE_MAX_POSITION = 16384


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """heads H, kv_heads K, head_dim D, rotary_half R/2 (0: no rotary dims), dtype of q and the
    pages, block_size B (slots per page), table_cols NB (block-table width), kv_mode,
    decode_only (every sequence has at most one query: the caller knows it), max_position (a
    bound on every position, or None), platform ("gpu" | "cpu"), interpret (Pallas kernels
    interpreted, on CPU)."""

    heads: int
    kv_heads: int
    head_dim: int
    rotary_half: int
    dtype: jnp.dtype
    block_size: int
    table_cols: int
    kv_mode: str = "position_free"
    decode_only: bool = False
    max_position: int | None = None
    platform: str = "cpu"
    interpret: bool = False

    @property
    def group(self) -> int:
        """G: query heads per kv head."""
        return self.heads // self.kv_heads

    @property
    def rotate_keys(self) -> bool:
        return self.kv_mode == "position_free"

    @property
    def table_bound(self) -> int | None:
        """max_position when a cos | sin table of that many rows is worth reading by default."""
        if self.max_position is not None and self.max_position <= TABLE_MAX_POSITION:
            return self.max_position
        return None

    def stand_ins(self):
        """(q [1, H, D], k_pages [1, B, K, D]) shape/dtype stand-ins, for limit functions that
        read arrays' shapes and dtypes."""
        return (jax.ShapeDtypeStruct((1, self.heads, self.head_dim), self.dtype),
                jax.ShapeDtypeStruct((1, self.block_size, self.kv_heads, self.head_dim),
                                     self.dtype))

    @classmethod
    def of(cls, q, k_pages, metadata, inv_freq, *, kv_mode: str, decode_only: bool = False,
           max_position: int | None = None, interpret: bool = False) -> Problem:
        """The problem of one paged_attention call (shapes already validated)."""
        return cls(heads=q.shape[1], kv_heads=k_pages.shape[2], head_dim=q.shape[2],
                   rotary_half=inv_freq.shape[-1], dtype=jnp.dtype(q.dtype),
                   block_size=k_pages.shape[1], table_cols=metadata.block_tables.shape[1],
                   kv_mode=kv_mode, decode_only=decode_only, max_position=max_position,
                   platform=jax.default_backend(), interpret=interpret)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
