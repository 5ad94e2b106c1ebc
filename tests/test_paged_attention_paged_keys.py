"""The Mosaic prefill kernel without a pre-pass (mosaic_prefill_paged.py): K and V read from the
pages through the table, keys rotated in SMEM by the memory warpgroup, vs the numpy reference.

On CPU the kernel runs under the Mosaic GPU interpreter; MINIPIC_COMPILED=1 compiles it for the
GPU. Batches: permuted tables, pads inside blocks (page starts that are no multiple of 8, so the
cos | sin boxes come from every shifted table copy), a page shared at another offset, GQA,
ragged lengths with partial last pages, and spans whose positions do not start at 0. Pad slots
hold large finite garbage (the values' contract, as direct_v's).
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention.mosaic_prefill_paged import (PagedOptions, paged_limits,
                                                                 paged_smem_bytes)
from kernels_pallas.paged_attention.mosaic_prefill_split import prefill_attention_split
from kernels_pallas.rope import apply_rope
from tests.test_paged_attention_mgpu_prefill import _inputs
from tests.test_paged_attention_mixed import _check, _finite_pads

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
slow = [pytest.mark.slow] if INTERPRET else []
# The interpreted rotating cases hung at times on the 2-core machine until tests/conftest.py set
# PJRT_NPROC (kernels_pallas/paged_attention/interpret_threads.py): an XLA CPU pool too small for
# three warpgroup threads, not the kernel's barrier protocol.


def _offset(md, shift: int):
    """The same batch with every position moved by `shift`: spans cached at an offset."""
    return dataclasses.replace(md, q_positions=md.q_positions + shift,
                               q_window_start=md.q_window_start + shift,
                               block_pos_start=md.block_pos_start + shift)


def _run(rng, specs, *, kv_heads=1, group=2, splits=2, shift=0, kv_mode="position_free",
         options=None, skip_idle=False):
    """The split kernel with paged keys; the cos | sin table bound covers the shifted positions
    (its default, table width x page size, is the engine's max_model_len)."""
    options = options or PagedOptions(max_position=shift + 1024)
    q, k, v, md, inv = _inputs(rng, jnp.bfloat16, kv_heads, group, 128, None, 0.3, True, specs)
    k, v = _finite_pads(rng, k, v)
    md = _offset(md, shift)
    rotate = kv_mode == "position_free"
    q_rot = apply_rope(q, md.q_positions, inv, 1.0)
    # jitted: the kernel's preparation ran op by op eagerly (~180 XLA programs a case)
    out = jax.jit(lambda *a: prefill_attention_split(
        *a, rotate_keys=rotate, attention_scaling=1.0, sm_scale=128 ** -0.5, splits=splits,
        min_steps=1, skip_idle=skip_idle, paged=options, interpret=INTERPRET))(
        q_rot, k, v, md, inv)
    return out, q, k, v, md, inv


# (specs, kv_heads, group, splits, shift, skip_idle): (cached, new, window) per sequence
CASES = [
    # a short span at offset 1003 over a permuted table with pads: one key step per split; its
    # 10 packed rows leave the second compute warpgroup idle (skip_idle, the mixed path's default)
    pytest.param([(100, 5, 0)], 1, 2, 2, 1003, True, id="offset-span-idle"),
    # three key steps in one range (the ring refilled), GQA 2 x 2, ragged, a window
    pytest.param([(300, 5, 0), (40, 9, 17)], 2, 2, 1, 0, False, id="gqa-ragged-window",
                 marks=slow),
]


@pytest.mark.parametrize("specs,kv_heads,group,splits,shift,skip_idle", CASES)
def test_paged_keys_match_reference(specs, kv_heads, group, splits, shift, skip_idle, fresh_rng):
    out, q, k, v, md, inv = _run(fresh_rng, specs, kv_heads=kv_heads, group=group, splits=splits,
                                 shift=shift, skip_idle=skip_idle)
    _check(out, q, k, v, md, inv, "position_free")


@pytest.mark.parametrize("cos_sin,v_first,prefetch", [
    ("keys", False, 1),  # the defaults, through a ring refill (3 key steps in one range)
    pytest.param("keys", True, 0, marks=slow), pytest.param("keys", True, 2, marks=slow),
    pytest.param("pages", True, 1, marks=slow),
    pytest.param("pages", False, 0, marks=slow)])  # the last: the first version
def test_paged_keys_options_match_reference(cos_sin, v_first, prefetch, fresh_rng):
    """Both cos | sin sources, both memory warpgroup orders and L2 prefetches (PagedOptions;
    interpreted, a prefetch is a no-op: this checks the schedule around it), page starts no
    multiple of 8 (offset 37)."""
    options = PagedOptions(max_position=1024 + 37, cos_sin=cos_sin, v_first=v_first,
                           prefetch=prefetch)
    out, q, k, v, md, inv = _run(fresh_rng, [(300, 5, 0)], splits=1, shift=37, options=options)
    _check(out, q, k, v, md, inv, "position_free")


def test_key_cos_sin_rows_are_the_rope_tables():
    """cos_sin "keys": each key's row is rope_table_in_graph's row of its position (the values
    the shifted table gave); a pad's sentinel position (1 << 30) gives a finite row."""
    from kernels_pallas.paged_attention.decode_common import rope_table_in_graph
    from kernels_pallas.paged_attention.mosaic_prefill_paged import key_cos_sin
    from kernels_pallas.paged_attention.random_inputs import inv_freq_for
    inv = inv_freq_for(128, None)
    pos = np.array([[0, 5, 33791, 1 << 30], [1003, 1004, 7, 8]], np.int32)
    got = np.asarray(key_cos_sin(jnp.asarray(pos), inv, 0.5, jnp.bfloat16), np.float32)
    table = rope_table_in_graph(inv, 33792, 0.5, jnp.bfloat16)
    live = pos < 1 << 30
    want = np.asarray(table[jnp.asarray(np.where(live, pos, 0))], np.float32)
    np.testing.assert_array_equal(got[live], want[live])
    assert np.isfinite(got).all()


def test_paged_options_name_a_bad_field():
    with pytest.raises(ValueError, match="cos_sin"):
        PagedOptions(cos_sin="table")
    with pytest.raises(ValueError, match="prefetch"):
        PagedOptions(prefetch=-1)


@pytest.mark.parametrize("packed", [pytest.param(True, marks=slow)])
def test_paged_keys_rotate_in_16_bit_math(packed, fresh_rng):
    out, q, k, v, md, inv = _run(fresh_rng, [(100, 5, 0)], shift=37,
                                 options=PagedOptions(max_position=1024, packed=packed))
    _check(out, q, k, v, md, inv, "position_free")


@pytest.mark.parametrize("specs,kv_heads,splits", [
    pytest.param([(100, 5, 0)], 1, 2, id="one-step"),
    # the unrotating path through ring refills and masked steps (a scratch run's 0.79 error
    # "without rotation" was position_free keys left unrotated against the rotating reference)
    pytest.param([(300, 5, 0), (40, 9, 17)], 2, 1, id="gqa-ragged-window", marks=slow)])
def test_paged_keys_in_rotated_mode_read_the_pages_as_stored(specs, kv_heads, splits, fresh_rng):
    """kv_mode "rotated": the same page reads, no rotation (keys stored rotated)."""
    out, q, k, v, md, inv = _run(fresh_rng, specs, kv_heads=kv_heads, splits=splits,
                                 kv_mode="rotated")
    _check(out, q, k, v, md, inv, "rotated")


def test_paged_keys_limits():
    assert paged_limits(128, 64, True, jnp.bfloat16, 16, 2112) == ""  # the engine's 33,792
    assert "head_dim 128" in paged_limits(64, 32, True, jnp.bfloat16, 16, 100)
    assert "full rotary" in paged_limits(128, 32, True, jnp.bfloat16, 16, 100)
    assert paged_limits(128, 32, False, jnp.bfloat16, 16, 100) == ""  # rotated: any rotary
    assert "bf16/f16" in paged_limits(128, 64, True, jnp.float32, 16, 100)
    assert "page size" in paged_limits(128, 64, True, jnp.bfloat16, 24, 100)
    assert "shared memory" in paged_limits(128, 64, True, jnp.bfloat16, 16, 4160)
    assert paged_smem_bytes(2112, 16, 2) <= 232448


def test_paged_keys_option_reaches_the_mixed_path():
    """MixedOptions.paged_k is off by default (not measured on the H200 yet) and checked by
    the mixed path's limits."""
    from kernels_pallas.paged_attention import api
    from kernels_pallas.paged_attention.problem import Problem
    problem = Problem(heads=32, kv_heads=8, head_dim=128, rotary_half=64, dtype=jnp.bfloat16,
                      block_size=16, table_cols=2112, platform="gpu")
    _, options = api.choose_attention(problem, "mixed")
    assert not options.paged_k
    _, options = api.choose_attention(problem, "mixed", {"paged_k": True})
    assert options.paged_k
    wide = dataclasses.replace(problem, head_dim=64, rotary_half=32)
    with pytest.raises(ValueError, match="head_dim 128"):
        api.choose_attention(wide, "mixed", {"paged_k": True})


@pytest.mark.parametrize("rotate,options", [  # paged_k is off: its option forms in the slow tier
    (True, PagedOptions()), (False, PagedOptions()),
    pytest.param(True, PagedOptions(v_first=True, prefetch=2), marks=slow),
    pytest.param(True, PagedOptions(cos_sin="pages", v_first=True, prefetch=0), marks=slow),
    (True, PagedOptions(rotator=(208, 24, 72)))])
def test_paged_keys_lower_for_cuda(rotate, options, fresh_rng):
    """The compiled kernel (rotation loads in the WGMMA layout from swizzled SMEM, page and
    cos | sin boxes through the SMEM table) lowers through Mosaic GPU for CUDA on this CPU-only
    machine."""
    from jax import export
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 2, 2, 128, None, 0.3, True,
                               [(300, 41, 0), (0, 20, 5)])
    fn = jax.jit(lambda q, k, v, md: prefill_attention_split(
        q, k, v, md, inv, rotate_keys=rotate, attention_scaling=1.0, sm_scale=0.1, splits=4,
        paged=options))
    text = export.export(fn, platforms=["cuda"])(q, k, v, md).mlir_module()
    assert "mosaic_gpu" in text
