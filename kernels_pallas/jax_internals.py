"""The JAX internals the project needs that JAX does not export, each behind one function here,
so every other module (tests aside) imports public JAX only (tests/test_kernel_entry_points.py
checks it). Each says why no public name serves; replace it when JAX exports one."""

from __future__ import annotations


def mosaic_gpu_mma_primitive():
    """The primitive behind `plgpu.mma`. jax.experimental.pallas.mosaic_gpu exports the function
    only (JAX 0.11.2), and the Mosaic GPU interpreter (CPU) has no lowering rule for its
    primitive: paged_attention/mosaic_common.register_interpreter_rules registers one, which
    takes the primitive itself."""
    from jax._src.pallas.mosaic_gpu import primitives  # no public export (see above)
    return primitives.mma_p
