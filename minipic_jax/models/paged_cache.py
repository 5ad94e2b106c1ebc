"""A layer's paged-cache step, shared by the model families: write this step's K/V rows (keys
rotated first only in "rotated" mode; position_free keys are stored unrotated), then attend
through the block table. The kernels run per head shard under tensor parallelism."""

from __future__ import annotations

from kernels_pallas.rope import apply_rope
from kernels_pallas.sharding import paged_attention, write_kv


def write_and_attend(q, k, v, k_pages, v_pages, metadata, inv_freq, *, attention_scaling: float,
                     kv_mode: str, attn_impl=None, write_impl=None, attn_options=None):
    """q [T, H, D] and k, v [T, K, D] unrotated; pages [P, B, K, D].
    Returns (attn [T, H, D], k_pages, v_pages)."""
    if kv_mode == "rotated":
        k = apply_rope(k, metadata.q_positions, inv_freq, attention_scaling)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, metadata.slot_mapping,
                                implementation=write_impl)
    attn = paged_attention(q, k_pages, v_pages, metadata, inv_freq, kv_mode=kv_mode,
                           attention_scaling=attention_scaling, implementation=attn_impl,
                           kernel_options=attn_options)
    return attn, k_pages, v_pages


def paged_attend(metadata, inv_freq, *, attention_scaling: float, kv_mode: str, attn_impl=None,
                 write_impl=None, attn_options=None):
    """attend(q, k, v, (k_pages, v_pages)) -> (attn, (k_pages, v_pages)): `write_and_attend` as
    the callable the families' attention modules take."""

    def attend(q, k, v, pages):
        attn, k_pages, v_pages = write_and_attend(
            q, k, v, *pages, metadata, inv_freq, attention_scaling=attention_scaling,
            kv_mode=kv_mode, attn_impl=attn_impl, write_impl=write_impl,
            attn_options=attn_options)  # [T, H, D]
        return attn, (k_pages, v_pages)
    return attend
