"""Paged attention: the XLA fallback and the ragged Triton kernel on the shared kernel cases
(tests/attention_test_base.py), the ragged kernel's own poisoned-output runs, and the API
(validation, jit, rotation at read == rotation before caching, write_kv).

On CPU the Pallas kernels run through the Pallas interpreter (`interpret=True`); on a GPU machine
set MINIPIC_COMPILED=1 to run the same cases compiled.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attention_test_base import (CASES, INTERPRET, AttentionKernelTests, Case, check,
                                 make_inputs, pytest_generate_tests)  # noqa: F401 (the hook)
from kernels_pallas.paged_attention.api import paged_attention, write_kv
from kernels_pallas.paged_attention.reference import (paged_attention_reference,
                                                     rotate_keys_reference)
from kernels_pallas.paged_attention import triton_ragged
from kernels_pallas.paged_attention.triton_ragged import (default_block_q, out_rows,
                                                          ragged_paged_attention_triton)
from kernels_pallas.rope import apply_rope


class TestXla(AttentionKernelTests):
    implementation = "xla"


class TestTriton(AttentionKernelTests):
    implementation = "triton"
    option_runs = (("f32-K1G4-D128R32-B8-mixed", {"block_k": 16}, False),
                   ("f32-K2G1-D64-B4-mixed", {"block_q": 1, "kv_group": 2}, False),
                   ("f32-K1G4-D64-B4-rotated-mixed", {"prerotate": True}, False),
                   ("bf16-K1G8-D256R64-B4-mixed", {"splits": 4}, True))  # split-K
    slow_cases = ("bf16-K1G8-D256R64-B4-mixed", "bf16-K2G4-D128-B16-decode",
                  "f16-K1G8-D128-B16-rotated-decode", "bf16-K2G2-D128-B16-mixed")


# The ragged kernel called directly with a NaN-poisoned output buffer: rows of no sequence stay
# untouched. Variants: default tiles, one-token tiles over all kv heads, prerotate flipped from
# its default; the bf16 cases' variants are slow when interpreted.
POISON_RUNS = [pytest.param(c, v, id=f"{c.name}-{v}", marks=[pytest.mark.slow] if (
    INTERPRET and v != "default" and c.dtype == jnp.bfloat16) else [])
    for c in CASES[:6] for v in ("default", "block_q1", "prerotate")]


@pytest.mark.parametrize("case,variant", POISON_RUNS)
def test_ragged_kernel_writes_only_its_rows(case, variant):
    q, k, v, md, inv = make_inputs(case)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode=case.kv_mode)
    q_rot = apply_rope(q, md.q_positions, inv)
    tokens, heads, _ = q.shape
    bq_default = default_block_q(tokens, md.num_seqs, case.group)
    opts = {"default": {}, "block_q1": {"block_q": 1, "kv_group": case.kv_heads},
            "prerotate": {"prerotate": bq_default * case.group < 64}}[variant]
    rows = out_rows(tokens, heads, case.kv_heads, opts.get("block_q") or bq_default,
                    opts.get("kv_group", 1))
    poison = jnp.full((rows, case.head_dim), jnp.nan, case.dtype)
    # under jit, as a step calls it: one compile, not one per eager op (CI time)
    out = jax.jit(lambda q_rot, k, v, md, out: ragged_paged_attention_triton(
        q_rot, k, v, md, inv, rotate_keys=case.kv_mode == "position_free", attention_scaling=1.0,
        sm_scale=case.head_dim ** -0.5, block_k=max(16, case.page_size), out=out,
        interpret=INTERPRET, **opts))(q_rot, k, v, md, poison)
    check(out, ref, md, case.dtype)
    assert np.all(np.isnan(np.asarray(out, np.float32)[int(md.cu_q_lens[-1]):])), \
        "kernel wrote rows that belong to no sequence"


# Split-K (triton_ragged module doc): (case, options) with one key step per page, so tiles span
# up to 6 steps; each run with a share of >= 1 step (every split works, some tiles' short ranges
# leave splits empty) and of >= MIN_SPLIT_STEPS (the later splits of every tile empty)
SPLIT_RUNS = [("f32-K2G1-D64-B4-mixed", {"block_q": 1, "kv_group": 2}),
              ("f32-K1G4-D128R32-B8-mixed", {}), ("f32-K2G4-D64R16-B4-decode-scaled", {})]


@pytest.mark.parametrize("min_steps", [1, triton_ragged.MIN_SPLIT_STEPS])
@pytest.mark.parametrize("name,opts", SPLIT_RUNS, ids=[n for n, _ in SPLIT_RUNS])
def test_split_key_ranges_merge_to_the_reference(name, opts, min_steps, monkeypatch):
    """Each tile's key steps split over 3 programs whose normalized partials and log-sum-exps
    are merged after the kernel: the reference's output, rows of no sequence left as `out` had
    them (NaN), and with one-step shares some tile's range really is split."""
    case = {c.name: c for c in CASES}[name]
    monkeypatch.setattr(triton_ragged, "MIN_SPLIT_STEPS", min_steps)
    q, k, v, md, inv = make_inputs(case)
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode=case.kv_mode,
                                    attention_scaling=case.scaling)
    tokens, heads, _ = q.shape
    block_q = opts.get("block_q") or default_block_q(tokens, md.num_seqs, case.group)
    # jitted: eagerly each op of the schedule was an XLA program of its own
    seq, start = jax.jit(lambda cu: triton_ragged.tile_schedule(cu, tokens, block_q))(
        md.cu_q_lens)
    lo, hi = jax.jit(lambda *a: triton_ragged.tile_step_range(*a, block_q, 1))(md, seq, start)
    assert min_steps > 1 or int(jnp.max(hi - lo)) >= 3, "no tile's range splits"
    poison = jnp.full((out_rows(tokens, heads, case.kv_heads, block_q, opts.get("kv_group", 1)),
                       case.head_dim), jnp.nan, case.dtype)
    out = jax.jit(lambda q_rot, k, v, md, out: ragged_paged_attention_triton(
        q_rot, k, v, md, inv, rotate_keys=case.kv_mode == "position_free",
        attention_scaling=case.scaling, sm_scale=case.head_dim ** -0.5, block_k=case.page_size,
        splits=3, out=out, interpret=INTERPRET, **opts))(
            apply_rope(q, md.q_positions, inv, attention_scaling=case.scaling), k, v, md, poison)
    check(out, ref, md, case.dtype)
    assert np.all(np.isnan(np.asarray(out, np.float32)[int(md.cu_q_lens[-1]):]))


def test_default_splits_fill_the_gpu_from_few_tiles_over_long_tables(monkeypatch):
    """A reordered span request's 128-token step (4 tiles x 2 kv heads) over a 25,600-key table
    splits 32 ways; a 1,024-token step 5 ways; tables of few steps and RAGGED_SPLITS off: less."""
    assert triton_ragged.default_splits(128, 32, 2, 400) == 32
    assert triton_ragged.default_splits(1024, 32, 2, 400) == 5
    assert triton_ragged.default_splits(128, 32, 2, 9) == 2
    assert triton_ragged.default_splits(8192, 32, 2, 400) == 1
    monkeypatch.setattr(triton_ragged, "RAGGED_SPLITS", False)
    assert triton_ragged.default_splits(128, 32, 2, 400) == 1


def _inputs(seed, dtype, kv_heads, group, head_dim, rotary_dim, page_size, specs, share=True):
    case = Case("api", dtype, kv_heads, group, head_dim, rotary_dim, page_size, "position_free",
                tuple(specs), seed=seed)
    return make_inputs(case, share=share)


def _rel_l2(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def test_api_under_jit_and_attention_scaling():
    case = dataclasses.replace(CASES[0], seed=3)
    q, k, v, md, inv = make_inputs(case)
    fn = jax.jit(lambda q, k, v, md: paged_attention(
        q, k, v, md, inv, attention_scaling=0.8, sm_scale=0.3, implementation="triton",
        interpret=INTERPRET, kernel_options={"block_k": 16}))
    ref = paged_attention_reference(q, k, v, md, inv, attention_scaling=0.8, sm_scale=0.3)
    check(fn(q, k, v, md), ref, md, case.dtype)


@functools.partial(jax.jit, static_argnames="kv_mode")
def _triton_attention(q, k, v, md, inv, *, kv_mode):
    return paged_attention(q, k, v, md, inv, kv_mode=kv_mode, implementation="triton",
                           interpret=INTERPRET, kernel_options={"block_k": 16})


def _padded_to_largest(q, k, v, md, inv, specs):
    """The pool and block tables grown to the largest random_batch draws for `specs` (every
    block holding one token), the added pages NaN and table columns unused: every seed's inputs
    have the same shapes, so the kernel is traced and compiled once per kv_mode, not once per
    draw (CI time)."""
    totals = [cached + new for cached, new, _ in specs]
    pages = sum(totals) + 3 - k.shape[0]  # random_batch: 3 pages no sequence uses
    cols = max(totals) + 1 - md.block_tables.shape[1]  # and 1 table column past the longest
    k, v = (jnp.pad(x, ((0, pages), (0, 0), (0, 0), (0, 0)), constant_values=jnp.nan)
            for x in (k, v))
    md = _replace(md, **{f: jnp.pad(getattr(md, f), ((0, 0), (0, cols))) for f in (
        "block_tables", "block_pos_start", "block_num_valid")})
    return q, k, v, md, inv


@settings(max_examples=8, deadline=None)
@given(offset=st.integers(0, 200_000), seed=st.integers(0, 2**31 - 1))
def test_rotation_at_read_equals_classic_path(offset, seed):
    """Keys stored unrotated + rotated at read == keys rotated before caching, at any offset."""
    specs = [(10, 3, 0), (6, 1, 2)]
    q, k, v, md, inv = _padded_to_largest(*_inputs(seed, jnp.float32, 1, 4, 64, 32, 4, specs,
                                                   share=False), specs)
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
    free = _triton_attention(q, k, v, md, inv, kv_mode="position_free")
    classic = _triton_attention(q, k_rot, v, md, inv, kv_mode="rotated")
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
