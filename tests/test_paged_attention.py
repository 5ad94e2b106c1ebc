"""Paged attention (Pallas kernel in interpret mode, and the XLA fallback) vs the numpy reference.

On CPU the Pallas kernel runs through the Pallas interpreter (`interpret=True`); on a GPU machine
set MINIPIC_COMPILED=1 to run the same cases compiled.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels_pallas.paged_attention.api import paged_attention, write_kv
from kernels_pallas.paged_attention.random_inputs import inv_freq_for, random_batch
from kernels_pallas.paged_attention.reference import (paged_attention_reference,
                                                     rotate_keys_reference)
from kernels_pallas.paged_attention.triton_decode import rope_table
from kernels_pallas.paged_attention.triton_ragged import (default_block_q, out_rows,
                                                          ragged_paged_attention_triton)
from kernels_pallas.rope import apply_rope

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# (dtype, kv_heads, group, head_dim, rotary_dim, page_size, kv_mode, specs)
MIXED = [(9, 5, 0), (0, 1, 0), (21, 1, 6), (3, 7, 2), (0, 12, 0)]
DECODE = [(13, 1, 0), (30, 1, 9), (5, 1, 0), (1, 1, 1)]
CASES = [
    (jnp.float32, 2, 1, 64, 64, 4, "position_free", MIXED),
    (jnp.float32, 1, 4, 128, 32, 8, "position_free", MIXED),
    (jnp.bfloat16, 1, 8, 256, 64, 4, "position_free", MIXED),
    (jnp.float32, 2, 4, 64, 16, 4, "position_free", DECODE),
    (jnp.bfloat16, 2, 4, 128, 128, 8, "position_free", DECODE),
    (jnp.float32, 1, 4, 64, 64, 4, "rotated", MIXED),
]


def _inputs(seed, dtype, kv_heads, group, head_dim, rotary_dim, page_size, specs, pad_tokens=2,
            share=True):
    rng = np.random.default_rng(seed)
    md, num_pages, tokens = random_batch(rng, specs, page_size=page_size, pad_prob=0.4,
                                         share=share, pad_tokens=pad_tokens,
                                         shuffle_entries=seed % 2 == 1)
    heads = kv_heads * group
    q = jnp.asarray(rng.standard_normal((tokens, heads, head_dim)), dtype)
    k = rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
    v = rng.standard_normal((num_pages, page_size, kv_heads, head_dim))
    # Slots no sequence may read (pads past a block's valid prefix, unused pages) hold NaN.
    readable = np.zeros((num_pages, page_size), bool)
    for s in range(md.num_seqs):
        for b in range(int(md.num_blocks[s])):
            readable[int(md.block_tables[s, b]), : int(md.block_num_valid[s, b])] = True
    k[~readable], v[~readable] = np.nan, np.nan
    return (q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), md,
            jnp.asarray(inv_freq_for(head_dim, rotary_dim)))


def _rel_l2(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _check(out, ref, md, dtype):
    n = int(md.cu_q_lens[-1])
    out = np.asarray(out).astype(np.float64)[:n]
    assert np.all(np.isfinite(out)), "kernel left rows unwritten (NaN poison survived)"
    err = _rel_l2(out, ref[:n])
    assert err < TOL[dtype], f"relative L2 error {err:.2e} >= {TOL[dtype]}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{jnp.dtype(c[0]).name}-K{c[1]}G{c[2]}"
                         f"-D{c[3]}R{c[4]}-B{c[5]}-{c[6]}-{len(c[7])}seq")
def test_kernel_matches_reference_poisoned(case):
    dtype, kv_heads, group, head_dim, rot, page_size, kv_mode, specs = case
    seed = CASES.index(case)  # odd seeds also shuffle table entries out of logical order
    q, k, v, md, inv = _inputs(seed, dtype, kv_heads, group, head_dim, rot, page_size, specs)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode=kv_mode)
    q_rot = apply_rope(q, md.q_positions, inv)
    tokens, heads, _ = q.shape
    variants = [{}, {"block_q": 1, "kv_group": kv_heads},
                {"prerotate": default_block_q(tokens, md.num_seqs, group) * group < 64}]
    for opts in variants:
        bq = opts.get("block_q") or default_block_q(tokens, md.num_seqs, group)
        rows = out_rows(tokens, heads, kv_heads, bq, opts.get("kv_group", 1))
        poison = jnp.full((rows, head_dim), jnp.nan, dtype)
        out = ragged_paged_attention_triton(
            q_rot, k, v, md, inv, rotate_keys=kv_mode == "position_free", attention_scaling=1.0,
            sm_scale=head_dim ** -0.5, block_k=max(16, page_size), out=poison,
            interpret=INTERPRET, **opts)
        _check(out, ref, md, dtype)
        assert np.all(np.isnan(np.asarray(out, np.float32)[int(md.cu_q_lens[-1]):])), \
            "kernel wrote rows that belong to no sequence"


DECODE_CASES = [  # (dtype, kv_heads, group, head_dim, rotary_dim, page_size, kv_mode, options,
    # attention_scaling: llama3/linear use 1.0, YaRN not)
    (jnp.float32, 4, 2, 64, 16, 4, "position_free", {"kv_group": 4, "splits": 3, "block_k": 16},
     0.8),
    (jnp.bfloat16, 2, 4, 128, 128, 8, "position_free", {"kv_group": 1, "splits": 2,
                                                         "block_k": 16}, 1.0),
    (jnp.float32, 2, 4, 64, 64, 4, "rotated", {"kv_group": 2, "splits": 1, "block_k": 16}, 1.0),
    # RoPE-at-read variants: cos/sin from a table (float32 / bfloat16), GQA 8, block_k 32.
    (jnp.float32, 4, 2, 64, 16, 4, "position_free", {"kv_group": 2, "splits": 3, "block_k": 16,
                                                      "rope": "table", "max_position": 64}, 0.8),
    (jnp.bfloat16, 2, 4, 128, 128, 8, "position_free", {"kv_group": 2, "splits": 2,
                                                         "block_k": 16, "rope": "table_bf16",
                                                         "max_position": 40}, 1.0),
    (jnp.float32, 2, 8, 64, 64, 4, "position_free", {"kv_group": 2, "splits": 2, "block_k": 32,
                                                      "rope": "trig"}, 1.0),
    (jnp.bfloat16, 2, 4, 128, 64, 4, "position_free", {"kv_group": 2, "splits": 2,
                                                        "block_k": 16, "rope": "trig"}, 0.8),
    # packed: bf16x2 key rotation (inline PTX when compiled, the same roundings in jnp when
    # interpreted); on by default for bf16, so the bf16 cases above use it unless packed=False.
    (jnp.bfloat16, 2, 4, 128, 128, 8, "position_free", {"kv_group": 2, "splits": 2,
                                                         "block_k": 16, "rope": "table_bf16",
                                                         "max_position": 40, "packed": True},
     0.8),
    (jnp.bfloat16, 2, 2, 64, 32, 8, "position_free", {"kv_group": 1, "splits": 3, "block_k": 32,
                                                       "packed": True}, 1.0),
    (jnp.bfloat16, 2, 4, 128, 128, 8, "position_free", {"kv_group": 2, "splits": 2,
                                                         "block_k": 16, "packed": False}, 0.8),
    # max_position alone: rope defaults to table_bf16 (bf16) / table (fp32)
    (jnp.bfloat16, 4, 2, 64, 64, 4, "position_free", {"kv_group": 4, "splits": 2, "block_k": 16,
                                                      "max_position": 48}, 1.0),
    (jnp.float32, 2, 4, 64, 64, 4, "position_free", {"kv_group": 2, "splits": 2, "block_k": 16,
                                                     "max_position": 48}, 0.8),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{jnp.dtype(c[0]).name}-K{c[1]}"
                         f"G{c[2]}-D{c[3]}R{c[4]}-{c[6]}-kvg{c[7]['kv_group']}s{c[7]['splits']}"
                         f"bk{c[7]['block_k']}-{c[7].get('rope', 'auto')}"
                         + "".join(f"-{f}{c[7][f]}" for f in ("packed", "max_position")
                                   if f in c[7]))
def test_decode_kernel_matches_reference(case):
    """Decode kernel: partial outputs start as NaN, so unwritten rows would show."""
    dtype, kv_heads, group, head_dim, rot, page_size, kv_mode, opts, scaling = case
    specs = DECODE + [(7, 0, 0)]  # plus a sequence with no query this step
    q, k, v, md, inv = _inputs(DECODE_CASES.index(case) + 11, dtype, kv_heads, group, head_dim,
                               rot, page_size, specs)
    out = paged_attention(q, k, v, md, inv, kv_mode=kv_mode, implementation="triton_decode",
                          attention_scaling=scaling, interpret=INTERPRET, kernel_options=opts)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode=kv_mode, attention_scaling=scaling)
    _check(out, ref, md, dtype)
    pad_rows = np.asarray(out, np.float32)[int(md.cu_q_lens[-1]):]
    assert pad_rows.size and np.all(pad_rows == 0), "rows that are no sequence's query must be 0"


def test_decode_rope_table_host_matches_traced():
    """The host-built cos|sin table (concrete inv_freq) equals the one built in the graph."""
    inv = jnp.asarray(inv_freq_for(64, theta=10000.0 * (1 + np.random.default_rng().random())))
    for dtype in (jnp.float32, jnp.bfloat16):
        host = rope_table(inv, 300, 0.8, dtype)
        traced = jax.jit(lambda i: rope_table(i, 300, 0.8, dtype))(inv)
        assert host.shape == traced.shape == (300, 64) and host.dtype == traced.dtype
        tol = 2e-6 if dtype == jnp.float32 else 8e-3  # float32 trig ulps / one bf16 rounding step
        np.testing.assert_allclose(np.asarray(host, np.float32), np.asarray(traced, np.float32),
                                   atol=tol, rtol=0)


def test_decode_rope_table_bounds():
    """rope='table' needs max_position above every query position."""
    q, k, v, md, inv = _inputs(6, jnp.float32, 2, 2, 16, 16, 4, DECODE)
    call = lambda **opts: paged_attention(q, k, v, md, inv, implementation="triton_decode",
                                          interpret=True, kernel_options=dict(rope="table", **opts))
    with pytest.raises(ValueError, match="max_position"):
        call()
    top = int(np.max(np.asarray(md.q_positions)[: int(md.cu_q_lens[-1])]))
    with pytest.raises(ValueError, match="max_position"):
        call(max_position=top)
    with pytest.raises(ValueError, match="packed=True"):  # bf16x2 rotation: bf16 inputs only
        call(max_position=64, packed=True)
    with pytest.raises(ValueError, match="rope must be one of"):
        paged_attention(q, k, v, md, inv, implementation="triton_decode", interpret=True,
                        kernel_options=dict(rope="cordic"))


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_api_matches_reference(implementation):
    dtype, kv_heads, group, head_dim, rot, page_size, kv_mode, specs = CASES[1]
    q, k, v, md, inv = _inputs(2, dtype, kv_heads, group, head_dim, rot, page_size, specs)
    out = paged_attention(q, k, v, md, inv, kv_mode=kv_mode, implementation=implementation,
                          interpret=INTERPRET, kernel_options={"block_k": 16})
    _check(out, paged_attention_reference(q, k, v, md, inv, kv_mode=kv_mode), md, dtype)


def test_api_under_jit_and_attention_scaling():
    dtype, kv_heads, group, head_dim, rot, page_size, _, specs = CASES[0]
    q, k, v, md, inv = _inputs(3, dtype, kv_heads, group, head_dim, rot, page_size, specs)
    fn = jax.jit(lambda q, k, v, md: paged_attention(
        q, k, v, md, inv, attention_scaling=0.8, sm_scale=0.3, implementation="triton",
        interpret=INTERPRET, kernel_options={"block_k": 16}))
    ref = paged_attention_reference(q, k, v, md, inv, attention_scaling=0.8, sm_scale=0.3)
    _check(fn(q, k, v, md), ref, md, dtype)


@settings(max_examples=8, deadline=None)
@given(offset=st.integers(0, 200_000), seed=st.integers(0, 2**31 - 1))
def test_rotation_at_read_equals_classic_path(offset, seed):
    """Keys stored unrotated + rotated at read == keys rotated before caching, at any offset."""
    q, k, v, md, inv = _inputs(seed, jnp.float32, 1, 4, 64, 32, 4, [(10, 3, 0), (6, 1, 2)],
                               share=False)
    md = _replace(md, q_positions=md.q_positions + offset,
                  q_window_start=md.q_window_start + offset,
                  block_pos_start=md.block_pos_start + offset)
    # The classic path: every stored key rotated by its logical position before the cache write.
    tables, starts = np.asarray(md.block_tables), np.asarray(md.block_pos_start)
    n_valid, nb = np.asarray(md.block_num_valid), np.asarray(md.num_blocks)
    k_np = np.asarray(k).astype(np.float64)
    k_rot = k_np.copy()
    for s in range(tables.shape[0]):
        for b in range(nb[s]):
            page = tables[s, b]
            pos = starts[s, b] + np.arange(n_valid[s, b])
            k_rot[page, : n_valid[s, b]] = rotate_keys_reference(k_np[page, : n_valid[s, b]], pos,
                                                                      np.asarray(inv))
    k_rot = jnp.asarray(k_rot, jnp.float32)
    opts = dict(implementation="triton", interpret=INTERPRET, kernel_options={"block_k": 16})
    free = paged_attention(q, k, v, md, inv, kv_mode="position_free", **opts)
    classic = paged_attention(q, k_rot, v, md, inv, kv_mode="rotated", **opts)
    n = int(md.cu_q_lens[-1])
    assert _rel_l2(np.asarray(free)[:n], np.asarray(classic).astype(np.float64)[:n]) < 1e-5


def test_write_kv_roundtrip():
    rng = np.random.default_rng(4)
    pages = jnp.asarray(rng.standard_normal((5, 4, 2, 8)), jnp.float32)
    k_new = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
    slots = np.array([3, 17, -1, 0, 19, -1], np.int32)
    k_out, v_out = write_kv(pages, pages, k_new, v_new, jnp.asarray(slots))
    k_exp = np.asarray(pages).reshape(20, 2, 8).copy()
    v_exp = k_exp.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            k_exp[slot], v_exp[slot] = np.asarray(k_new[t]), np.asarray(v_new[t])
    np.testing.assert_array_equal(np.asarray(k_out).reshape(20, 2, 8), k_exp)
    np.testing.assert_array_equal(np.asarray(v_out).reshape(20, 2, 8), v_exp)


def _replace(md, **kw):
    return dataclasses.replace(md, **kw)


def test_validation_errors():
    q, k, v, md, inv = _inputs(5, jnp.float32, 2, 2, 16, 16, 4, [(5, 2, 0), (3, 1, 0)])
    call = lambda *a, **kw: paged_attention(*a, implementation="xla", **kw)
    with pytest.raises(ValueError, match="multiple of"):
        call(q[:, :3], k, v, md, inv)
    with pytest.raises(ValueError, match="head_dim"):
        call(q[..., :8], k, v, md, inv)
    with pytest.raises(ValueError, match="dtype"):
        call(q.astype(jnp.int32), k, v, md, inv)
    with pytest.raises(ValueError, match="k_pages"):
        call(q, k, v.astype(jnp.bfloat16), md, inv)
    with pytest.raises(ValueError, match="kv_mode"):
        call(q, k, v, md, inv, kv_mode="roped")
    with pytest.raises(ValueError, match="outside the pool"):
        call(q, k, v, _replace(md, block_tables=md.block_tables.at[1, 0].set(k.shape[0])), inv)
    with pytest.raises(ValueError, match="outside the pool"):
        call(q, k, v, _replace(md, block_tables=md.block_tables.at[0, 0].set(-1)), inv)
    with pytest.raises(ValueError, match="uses 9 blocks"):
        call(q, k, v, _replace(md, num_blocks=md.num_blocks.at[0].set(9)), inv)
    with pytest.raises(ValueError, match="block_num_valid"):
        call(q, k, v, _replace(md, block_num_valid=md.block_num_valid.at[0, 0].set(5)), inv)
    with pytest.raises(ValueError, match="cu_q_lens"):
        call(q, k, v, _replace(md, cu_q_lens=md.cu_q_lens.at[-1].set(q.shape[0] + 1)), inv)
    with pytest.raises(ValueError, match="int32"):
        call(q, k, v, _replace(md, q_positions=md.q_positions.astype(jnp.int16)), inv)
    with pytest.raises(ValueError, match="metadata.q_positions"):
        call(q, k, v, _replace(md, q_positions=md.q_positions[:-1]), inv)
    with pytest.raises(ValueError, match="unknown implementation"):
        paged_attention(q, k, v, md, inv, implementation="cuda")
    with pytest.raises(ValueError, match="decode-only"):
        paged_attention(q, k, v, md, inv, implementation="triton_decode", interpret=True)
    with pytest.raises(ValueError, match="power-of-2 rotary"):
        paged_attention(q, k, v, md, jnp.ones((3,), jnp.float32), implementation="triton")
