"""The kernels an engine's steps run, chosen once at start by the kernel registry's policy for
the model's shapes (the attention kernels of general and of decode-only steps, a hybrid model's
gated delta prefill kernel): a named kernel that cannot take the model is a ValueError naming
the option, before any work. ModelRunner calls them (tests replace them there to choose as on a
GPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.gated_delta import api as gated_delta_api
from kernels_pallas.paged_attention.api import choose_attention
from kernels_pallas.paged_attention.problem import Problem


def attention_choices(config, mcfg, dtype, platform: str | None = None):
    """The attention kernels of general and of decode-only steps, each (implementation name,
    options), from the kernel registry's one policy (paged_attention.api.choose_attention),
    asked with the model's shapes, the block-table width and max_model_len as the position
    bound. Config.decode_attn_impl None: the same implementation setting as attn_impl (for
    "auto", the decode-only list)."""
    problem = Problem(heads=mcfg.num_heads, kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
                      rotary_half=mcfg.rotary_dim // 2, dtype=jnp.dtype(dtype),
                      block_size=config.block_size, table_cols=config.max_blocks_per_seq,
                      kv_mode=config.attention_kv_mode, max_position=config.max_model_len,
                      platform=platform or jax.default_backend())
    general, general_options = choose_attention(problem, config.attn_impl)
    if general.decode_only:
        raise ValueError(f"Config.attn_impl={config.attn_impl!r} is decode-only; name it in "
                         f"decode_attn_impl instead")
    decode, decode_options = choose_attention(
        dataclasses.replace(problem, decode_only=True),
        config.decode_attn_impl or config.attn_impl, config.decode_attn_options)
    return (general.name, general_options), (decode.name, decode_options)


def gdn_choice(config, family, mcfg, dtype, platform: str | None = None) -> str | None:
    """The gated delta prefill kernel of a hybrid model's steps (None for a model without
    recurrent layers): Config.gdn.impl resolved once by the kernel registry's policy
    (gated_delta.api.choose_gated_delta) for the model's shapes (its values' dtype, Dk, Dv and
    chunk). A name that cannot take them is a ValueError naming the option, the name and why;
    so is any name but "auto" for a model without gated delta layers (nothing would run it)."""
    if not family.IS_HYBRID:  # the family contract's flag
        if config.gdn.impl != "auto":
            raise ValueError(f"gdn_impl (Config.gdn.impl)={config.gdn.impl!r} chooses the gated "
                             f"delta kernel of hybrid models; this model has no gated delta "
                             f"layers (leave it 'auto')")
        return None
    problem = gated_delta_api.Problem(
        platform=platform or jax.default_backend(), dtype=jnp.dtype(dtype).name,
        key_dim=mcfg.linear_key_head_dim, value_dim=mcfg.linear_value_head_dim,
        chunk=family.CHUNK)
    impl, _ = gated_delta_api.choose_gated_delta(problem, config.gdn.impl,
                                                 op="gdn_impl (Config.gdn.impl)")
    return impl.name
