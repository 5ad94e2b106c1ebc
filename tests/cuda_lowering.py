"""Lowering for CUDA on a CPU machine, for tests that count what a GPU program would hold:
an abstract H100 to lower under (Triton's lowering asks for the device) and the abstract shapes
of Qwen3.5-0.8B's span-map pool."""

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
