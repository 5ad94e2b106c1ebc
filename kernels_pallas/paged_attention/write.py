"""`write_kv`: store new K/V rows into their cache slots, through the kernel registry."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas import registry
from kernels_pallas.paged_attention import triton_write
from kernels_pallas.registry import Implementation


@dataclasses.dataclass(frozen=True)
class WriteProblem:
    """cache_elements: P * B * K * D of one cache array; platform "gpu" | "cpu"; interpret."""

    cache_elements: int
    platform: str = "cpu"
    interpret: bool = False


def scatter_rows(k_pages, v_pages, k, v, slot_mapping, *, interpret=False):
    """The XLA write: one scatter per cache array."""
    del interpret
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    flat = num_pages * page_size
    # Every row gets a distinct index (real slots are distinct by construction; dropped rows go
    # to distinct out-of-range indices), so XLA may scatter without atomics or serialisation.
    rows = jnp.arange(slot_mapping.shape[0], dtype=jnp.int32)
    slots = jnp.where(slot_mapping < 0, flat + rows, slot_mapping)

    def scatter(pages, new):
        return pages.reshape(flat, kv_heads, head_dim).at[slots].set(
            new.astype(pages.dtype), mode="drop", unique_indices=True).reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)


WRITE = {"xla": Implementation("xla", scatter_rows), "triton": triton_write.IMPLEMENTATION}
WRITE_IMPLEMENTATIONS = ("auto",) + tuple(WRITE)


def auto_order(problem: WriteProblem) -> tuple[str, ...]:
    """The Pallas row copy on a GPU (a general scatter measured 55-64 us per layer there;
    benchmarks/history/engine.md), XLA elsewhere."""
    return ("triton", "xla") if problem.platform == "gpu" or problem.interpret else ("xla",)


def write_kv(k_pages, v_pages, k, v, slot_mapping, *, implementation: str | None = "auto",
             options=None, interpret: bool = False):
    """Scatter new K/V rows into their slots; rows with slot -1 are dropped.

    Args:
      k_pages, v_pages: [P, B, K, D] cache of one layer.
      k, v: [T, K, D] new rows (unrotated in position_free mode).
      slot_mapping: [T] int32 flat slot page * B + offset, or -1; real slots are distinct.
      implementation: "auto" (or None: the Pallas row copy on GPU where int32 offsets reach,
        else XLA), "xla" (a scatter) or "triton" (Pallas, Triton lowering, pages aliased in
        place; triton_write.py). A named Pallas implementation runs interpreted on CPU.
      options: the implementation's options (a dict or its dataclass).
      interpret: run the Pallas kernel in interpret mode.
    Returns:
      (k_pages, v_pages) updated.
    """
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    if k.shape[1:] != (kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"write_kv: k/v {k.shape}/{v.shape} do not match pages {k_pages.shape}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"write_kv: slot_mapping {slot_mapping.shape} must be [{k.shape[0]}]")
    problem = WriteProblem(cache_elements=num_pages * page_size * kv_heads * head_dim,
                           platform=jax.default_backend(), interpret=interpret)
    impl, opts = registry.choose("write_kv", WRITE, auto_order(problem), problem,
                                 implementation or "auto", options)
    interpret = interpret or (impl.backend != "xla" and problem.platform == "cpu")
    if problem.platform == "gpu" and not interpret:
        return _write_once(k_pages, v_pages, k, v, slot_mapping, name=impl.name, options=opts)
    return impl.run(k_pages, v_pages, k, v, slot_mapping, interpret=interpret,
                    **impl.kwargs(opts))


@functools.partial(jax.jit, static_argnames=("name", "options"))
def _write_once(k_pages, v_pages, k, v, slot_mapping, *, name, options):
    """The write under its own jit, as paged_attention's kernels (api._run_once): a model's
    layers call it with the same shapes, so it is traced and lowered once per step variant and
    each layer calls that one function (XLA inlines the call: the same program). Traced per
    layer, the Triton write was a third of the 8B step's trace and lower time on the host
    (benchmarks/lower_time.py)."""
    impl = WRITE[name]
    return impl.run(k_pages, v_pages, k, v, slot_mapping, interpret=False, **impl.kwargs(options))
