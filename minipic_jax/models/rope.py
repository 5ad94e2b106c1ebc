"""RoPE frequencies from a ModelConfig, computed exactly as HF transformers does.

The rotation itself lives in `kernels_pallas.rope.apply_rope` (shared with the attention kernels);
this module only turns a config into `inv_freq` [R/2] and the cos/sin `attention_scaling`. The math
runs in float32 step by step like HF's torch code, so the frequencies agree to the last ulp or so.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from configs.model_config import ModelConfig, RopeConfig

ROPE_TYPES = ("default", "llama3", "linear")


def _base_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    # torch's float32 pow(scalar, tensor) is correctly rounded: form it in float64, round once.
    powers = (np.float64(rope.theta) ** exponents.astype(np.float64)).astype(np.float32)
    return (np.float32(1.0) / powers).astype(np.float32)


def _llama3(inv: np.ndarray, rope: RopeConfig) -> np.ndarray:
    factor = np.float32(rope.factor)
    old_ctx = rope.original_max_position_embeddings
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    # torch evaluates `scalar / tensor` as reciprocal(tensor) * scalar; mirror it bit for bit.
    wavelen = ((np.float32(1) / inv) * np.float32(2 * math.pi)).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
    smooth = (((np.float32(1) / wavelen) * np.float32(old_ctx) - np.float32(rope.low_freq_factor))
              / np.float32(rope.high_freq_factor - rope.low_freq_factor)).astype(np.float32)
    smoothed = ((np.float32(1) - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(rope: RopeConfig, head_dim: int) -> np.ndarray:
    if rope.rope_type not in ROPE_TYPES:
        raise ValueError(f"RoPE type {rope.rope_type!r} is not supported; supported: {ROPE_TYPES}")
    dim = int(head_dim * rope.partial_rotary_factor)
    if dim <= 0 or dim % 2:
        raise ValueError(f"rotary dim int({head_dim} * {rope.partial_rotary_factor}) = {dim} "
                         f"must be a positive even number")
    inv = _base_inv_freq(rope, dim)
    if rope.rope_type == "linear":
        inv = (inv / np.float32(rope.factor)).astype(np.float32)
    elif rope.rope_type == "llama3":
        inv = _llama3(inv, rope)
    inv.flags.writeable = False
    return inv


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [R/2] float32, R = int(head_dim * partial_rotary_factor).

    Same values as HF's rope init functions for rope_type default / llama3 / linear. Read-only
    (cached per config); jitted code sees it as a constant.
    """
    return _inv_freq_cached(cfg.rope, cfg.head_dim)


def attention_scaling(cfg: ModelConfig) -> float:
    """cos/sin multiplier HF applies after the rope init: 1.0 for default, llama3 and linear."""
    if cfg.rope.rope_type not in ROPE_TYPES:
        raise ValueError(f"RoPE type {cfg.rope.rope_type!r} is not supported; supported: {ROPE_TYPES}")
    return 1.0
