"""Lowering for CUDA on a CPU machine, for tests that count what a GPU program would hold:
an abstract H100 to lower under (Triton's lowering asks for the device), the abstract shapes
of Qwen3.5-0.8B's span-map pool and a capturing span step lowered at its widths."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


@contextlib.contextmanager
def abstract_h100():
    """Inside: `.lower(lowering_platforms=("cuda",))` lowers as for one H100."""
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                       platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
            (1,), ("gpu",), abstract_device=h100)):
        yield


def map_pool_0_8b(slots: int = 64):
    """An abstract span-map pool of Qwen3.5-0.8B's shapes (18 GDN layers x 16 heads, Dk = Dv =
    128, bf16 conv tails of 6,144 channels)."""
    from serving.hybrid import span_maps
    sd = jax.ShapeDtypeStruct
    maps = sd((slots, 18, 16, 128, 128), jnp.float32)
    return span_maps.SpanMapPool(a=maps, b=maps, tail=sd((slots, 18, 6144, 3), jnp.bfloat16),
                                 count=sd((slots,), jnp.int32), zero_a=sd((slots, 18, 16), bool))


def capturing_step_text() -> str:
    """A capturing warm span step at Qwen3.5-0.8B's widths (one GDN layer), rag's 1,024 rows x
    16 sequences, lowered for an H100 under the module switches as they are: its StableHLO
    text. The caller makes jax.default_backend() say "gpu" (the kernels chosen as on one)."""
    import numpy as np

    from benchmarks import span_step_ops
    from minipic_jax.models import qwen3_5
    cfg = span_step_ops.model_cfg(1)
    md, logits_idx, pieces, rec = span_step_ops.step_inputs(1024, 16, True,
                                                            np.random.default_rng(0))
    params = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 16 * 80, 16, 16, jnp.bfloat16))

    def step(params, tokens, md, cache, rec, logits_idx, span):  # a new function: traced anew
        return qwen3_5.forward_with_checkpoints(
            params, tokens, md, cache, cfg, recurrent=rec, logits_indices=logits_idx,
            gdn_impl="pallas_fused", span_pieces=span)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (params, jnp.zeros(md.num_tokens, jnp.int32), md, cache, rec,
                         logits_idx, pieces))
    with abstract_h100():
        return jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
