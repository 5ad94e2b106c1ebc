"""Mosaic GPU prefill kernel (implementation="mosaic_prefill") vs the numpy reference.

On CPU the real kernel runs under the Mosaic GPU interpreter, whose buffers start as NaN (so
unwritten output rows show) and which can check for races; MINIPIC_COMPILED=1 compiles it for
the GPU instead. Inputs are seeded random ragged batches (salt printed on failure): cached
context, window starts, pads inside blocks, a physical page shared by two sequences at different
offsets, permuted table entries, GQA, partial rotary, decode rows mixed in.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.api import paged_attention
from kernels_pallas.paged_attention.random_inputs import inv_freq_for, random_batch
from kernels_pallas.paged_attention.reference import paged_attention_reference

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
# each interpreted case costs ~8-10 s on 2 cores: one in the default run, all with --run-slow
SLOW_INTERPRETED = [pytest.mark.slow] if INTERPRET else []

# (dtype, kv_heads, group, head_dim, rotary_dim, kv_mode, pad_prob, shuffle, specs): specs are
# (cached, new, window) per sequence; > 128 new tokens spans two query tiles, > 128 keys two steps.
CASES = [
    # no pads: the tiles' middle key steps take the unmasked path; window 150 skips key step 0
    (jnp.bfloat16, 1, 2, 64, None, "position_free", 0.0, False,
     [(96, 150, 0), (0, 37, 0), (5, 1, 0), (200, 30, 150)]),
    pytest.param((jnp.bfloat16, 2, 2, 128, None, "rotated", 0.3, True,
                  [(40, 70, 17), (0, 20, 0), (130, 1, 3)]), marks=SLOW_INTERPRETED),
    pytest.param((jnp.float16, 1, 3, 64, 32, "position_free", 0.3, True,
                  [(20, 140, 60), (0, 9, 0)]), marks=SLOW_INTERPRETED),
]


def _inputs(rng, dtype, kv_heads, group, head_dim, rotary_dim, pad_prob, shuffle, specs):
    page_size = 16
    md, num_pages, tokens = random_batch(rng, specs, page_size=page_size, pad_prob=pad_prob,
                                         share=True, shuffle_entries=shuffle)
    heads = kv_heads * group
    shape = (num_pages, page_size, kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((tokens, heads, head_dim)), dtype)
    k = rng.standard_normal(shape)
    v = rng.standard_normal(shape)
    used = np.zeros((num_pages, page_size), bool)  # slots some sequence reads
    tables, nv, nb = (np.asarray(x) for x in (md.block_tables, md.block_num_valid, md.num_blocks))
    for s in range(tables.shape[0]):
        for b in range(nb[s]):
            used[tables[s, b], : nv[s, b]] = True
    k[~used], v[~used] = np.nan, np.nan  # pad slots hold garbage: the kernel must never use it
    inv = jnp.asarray(inv_freq_for(head_dim, rotary_dim))
    return q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), md, inv


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{jnp.dtype(c[0]).name}-K{c[1]}-G{c[2]}"
                         f"-D{c[3]}-R{c[4] or c[3]}-{c[5]}")
def test_mosaic_prefill_matches_reference(case, fresh_rng):
    dtype, kv_heads, group, head_dim, rotary_dim, kv_mode, pad_prob, shuffle, specs = case
    q, k, v, md, inv = _inputs(fresh_rng, dtype, kv_heads, group, head_dim, rotary_dim, pad_prob,
                               shuffle, specs)
    first = case == CASES[0]
    interpret = (plgpu.InterpretGPUParams(detect_races=first) if INTERPRET else False)
    # jitted: eagerly the kernel's preparation ran op by op (an XLA program each)
    out = jax.jit(lambda *a: paged_attention(*a, kv_mode=kv_mode, implementation="mosaic_prefill",
                                             interpret=interpret))(q, k, v, md, inv)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode=kv_mode)
    out = np.asarray(out.astype(jnp.float32)).astype(np.float64)
    assert np.all(np.isfinite(out)), "kernel left output rows unwritten (NaN) or read a pad"
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert err < 2e-2, f"relative L2 error {err:.2e}"
    if INTERPRET and first:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
        assert not ipc.get_races().races_found, "race detector found a data race"


@pytest.mark.skipif(not INTERPRET, reason="the race detector is the interpreter's")
def test_ring_slots_refilled_after_masked_steps_are_race_free(fresh_rng):
    """Pads put masked key steps early in a 5+-step walk, so a slot whose key positions a masked
    step read (generic proxy) is refilled by TMA (async proxy): the reads must be committed
    (fence.proxy.async) before the slot is released, or the detector reports the refill."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    from kernels_pallas.paged_attention.mosaic_prefill import prefill_attention_mosaic
    from kernels_pallas.rope import apply_rope
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 1, 2, 64, None, 0.2, True,
                               [(600, 5, 0), (130, 36, 0)])
    q_rot = apply_rope(q, md.q_positions, inv, 1.0)
    out = jax.jit(lambda *a: prefill_attention_mosaic(
        *a, rotate_keys=True, attention_scaling=1.0, sm_scale=64 ** -0.5,
        interpret=plgpu.InterpretGPUParams(detect_races=True)))(q_rot, k, v, md, inv)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode="position_free")
    rows = int(np.asarray(md.cu_q_lens)[-1])
    out = np.asarray(out.astype(jnp.float32)).astype(np.float64)[:rows]
    assert np.all(np.isfinite(out))
    err = float(np.linalg.norm(out - ref[:rows]) / np.linalg.norm(ref[:rows]))
    assert err < 2e-2, f"relative L2 error {err:.2e}"
    assert not ipc.get_races().races_found, "race detector found a data race"


def test_mosaic_prefill_rejects_what_it_cannot_run(fresh_rng):
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 1, 2, 256, None, 0.0, False, [(0, 3, 0)])
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        paged_attention(q, k, v, md, inv, implementation="mosaic_prefill", interpret=True)
    q, k, v, md, inv = _inputs(fresh_rng, jnp.float32, 1, 2, 64, None, 0.0, False, [(0, 3, 0)])
    with pytest.raises(ValueError, match="bf16/f16"):
        paged_attention(q, k, v, md, inv, implementation="mosaic_prefill", interpret=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_mosaic_prefill_compiled_path_lowers_for_cuda(head_dim, fresh_rng, monkeypatch):
    """The compiled variant (P in registers, no interpreter) lowers through Mosaic GPU for CUDA
    on this CPU-only machine (cross-platform export): layouts, TMA boxes and alignment proofs.
    The compiled pre-pass's Triton gather cannot lower without a GPU: the XLA gather stands in
    (test_gather_live.py checks the two agree)."""
    from jax import export
    from kernels_pallas.paged_attention import mosaic_prefill_prep
    from kernels_pallas.paged_attention.mosaic_prefill import prefill_attention_mosaic
    monkeypatch.setattr(mosaic_prefill_prep, "LIVE_GATHER", False)
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 2, 2, head_dim, None, 0.3, True,
                               [(40, 301, 0), (0, 20, 5)])  # T = 321: not a multiple of 8
    for rotate in (False, True):
        fn = jax.jit(lambda q, k, v, md, rotate=rotate: prefill_attention_mosaic(
            q, k, v, md, inv, rotate_keys=rotate, attention_scaling=1.0, sm_scale=0.1))
        text = export.export(fn, platforms=["cuda"])(q, k, v, md).mlir_module()
        assert "mosaic_gpu" in text


@pytest.mark.parametrize("split", [False, True])
def test_mosaic_prefill_options_lower_for_cuda(split, fresh_rng, monkeypatch):
    """direct_v (values by one TMA box per page through the page table in SMEM) and skip_idle
    (idle warpgroups walk the barriers) lower for CUDA too, whole and with the key axis split."""
    from jax import export
    from kernels_pallas.paged_attention import mosaic_prefill_prep
    from kernels_pallas.paged_attention.mosaic_prefill import prefill_attention_mosaic
    from kernels_pallas.paged_attention.mosaic_prefill_split import prefill_attention_split
    monkeypatch.setattr(mosaic_prefill_prep, "LIVE_GATHER", False)
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 2, 2, 128, None, 0.3, True,
                               [(300, 41, 0), (0, 20, 5)])
    kw = dict(rotate_keys=True, attention_scaling=1.0, sm_scale=0.1, direct_v=True,
              skip_idle=True)
    if split:
        fn = jax.jit(lambda q, k, v, md: prefill_attention_split(q, k, v, md, inv, splits=4,
                                                                 **kw))
    else:
        fn = jax.jit(lambda q, k, v, md: prefill_attention_mosaic(q, k, v, md, inv, **kw))
    text = export.export(fn, platforms=["cuda"])(q, k, v, md).mlir_module()
    assert "mosaic_gpu" in text


from attention_test_base import (CASES as SHARED_CASES, AttentionKernelTests,  # noqa: E402
                                 pytest_generate_tests)  # noqa: F401,E402 (the hook)


class TestMosaicPrefill(AttentionKernelTests):
    """The shared kernel cases it takes (bf16/f16, head_dim 64/128), compiled or with
    --run-slow: interpreted, each costs ~15 s, and the cases above keep it in the default run."""

    implementation = "mosaic_prefill"
    slow_cases = tuple(c.name for c in SHARED_CASES)
