"""The engine's prefill / mixed step path (implementation="mixed", mosaic_mixed.py) and the Mosaic
prefill kernel with a split key axis (mosaic_prefill_split.py) vs the numpy reference.

On CPU the Mosaic kernels run under the Mosaic GPU interpreter (buffers start as NaN, so an
unwritten row shows); MINIPIC_COMPILED=1 compiles them for the GPU. Batches are seeded random
ragged batches (salt printed on failure) with pads, shared pages and permuted tables.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention.api import paged_attention
from kernels_pallas.paged_attention.mosaic_mixed import compact_prefill, decode_batch
from kernels_pallas.paged_attention.mosaic_prefill_split import prefill_attention_split
from kernels_pallas.paged_attention.reference import paged_attention_reference
from tests.test_paged_attention_mgpu_prefill import _inputs
from jaxpr_walk import KERNELS, primitive_counts

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
# Larger interpreted batches take minutes on the 2-core CI machine: marked slow there (run them
# with --run-slow); compiled on a GPU they always run.
slow = [pytest.mark.slow] if INTERPRET else []


def _check(out, q, k, v, md, inv, kv_mode):
    ref = paged_attention_reference(q, k, v, md, inv, kv_mode=kv_mode)
    out = np.asarray(jnp.asarray(out, jnp.float32)).astype(np.float64)
    rows = np.asarray(md.cu_q_lens)[-1]
    assert np.all(np.isfinite(out[:rows])), "a row was left unwritten (NaN) or read a pad"
    err = float(np.linalg.norm(out[:rows] - ref[:rows]) / np.linalg.norm(ref[:rows]))
    assert err < 2e-2, f"relative L2 error {err:.2e}"


def _finite_pads(rng, k, v):
    """The pad slots (NaN from _inputs) as finite garbage, large so that a pad which leaked into
    an output would show: the contract of direct_v and of mosaic_decode (the engine guarantees it
    by zeroing every page when the block manager hands it out, before the step that first uses it:
    serving/cache/page_zeroing.py, tests/test_page_zeroing.py), and the mixed path's default (direct_v
    on)."""
    garbage = jnp.asarray(rng.uniform(50.0, 100.0, v.shape), v.dtype)
    return tuple(jnp.where(jnp.isnan(x), garbage, x) for x in (k, v))


SPLIT_CASES = [
    # one sequence: 5 queries over 600 cached keys (5 key steps, 3 ranges of 2 steps)
    pytest.param([(600, 5, 0)], 2, id="few-rows-long-context", marks=slow),
    # the cached-span shape in small, next to a short sequence (one range) and an empty one
    pytest.param([(1000, 20, 0), (0, 3, 0), (40, 0, 0)], 4, id="mixed-lengths", marks=slow),
]


@pytest.mark.parametrize("specs,splits", SPLIT_CASES)
def test_split_key_axis_matches_reference(specs, splits, fresh_rng):
    """A few query rows over a long cached context (the cached-span step), the key axis split
    into ranges of >= 2 steps."""
    from kernels_pallas.rope import apply_rope
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 1, 2, 64, None, 0.2, True, specs)
    q_rot = apply_rope(q, md.q_positions, inv, 1.0)  # the kernel takes rotated queries
    out = prefill_attention_split(q_rot, k, v, md, inv, rotate_keys=True, attention_scaling=1.0,
                                  sm_scale=64 ** -0.5, splits=splits, min_steps=2,
                                  interpret=INTERPRET)
    _check(out, q, k, v, md, inv, "position_free")


DIRECT_V_CASES = [
    # one sequence over a long context: whole ranges of unmasked steps read V from the pages
    pytest.param(1, 2, 64, [(600, 5, 0)], 2, id="long-context"),
    # GQA, D 128, a short sequence, an empty one, a window: masked steps over pads and entries
    # past the table read clipped pages whose values p = 0 must cancel
    pytest.param(2, 2, 128, [(300, 20, 0), (0, 3, 0), (40, 0, 0), (90, 9, 40)], 3,
                 id="gqa-mixed-lengths", marks=slow),
]


@pytest.mark.parametrize("kv_heads,group,head_dim,specs,splits", DIRECT_V_CASES)
def test_split_with_values_from_the_pages_matches_reference(kv_heads, group, head_dim, specs,
                                                             splits, fresh_rng):
    """direct_v: the kernel reads V through the page table (8 page boxes a key step), the
    pre-pass gathers keys only. Its contract (as mosaic_decode's) is finite values in every page
    slot, so the pads hold finite garbage here (large, so a pad that leaked would show)."""
    from kernels_pallas.rope import apply_rope
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, kv_heads, group, head_dim, None, 0.3,
                               True, specs)
    k, v = _finite_pads(fresh_rng, k, v)
    q_rot = apply_rope(q, md.q_positions, inv, 1.0)
    kw = dict(rotate_keys=True, attention_scaling=1.0, sm_scale=head_dim ** -0.5, splits=splits,
              min_steps=2, interpret=INTERPRET)
    # jitted: eagerly the kernel's preparation ran op by op (~200 XLA programs a case)
    out = jax.jit(lambda *a: prefill_attention_split(*a, direct_v=True, **kw))(q_rot, k, v, md,
                                                                                inv)
    _check(out, q, k, v, md, inv, "position_free")


@pytest.mark.parametrize("slots", [pytest.param(2, marks=slow)])
def test_mixed_step_with_values_from_the_pages_matches_reference(slots, fresh_rng):
    """MixedOptions.direct_v through the registry: decode rows and a prefill chunk, finite pads
    (the contract of direct_v and of the decode kernel)."""
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 2, 2, 64, None, 0.2, True,
                               [(60, 1, 0), (200, 30, 0), (0, 17, 5)])
    k, v = _finite_pads(fresh_rng, k, v)
    out = paged_attention(q, k, v, md, inv, kv_mode="position_free", implementation="mixed",
                          interpret=INTERPRET,
                          kernel_options={"prefill_seqs": slots, "direct_v": True})
    _check(out, q, k, v, md, inv, "position_free")


@pytest.mark.parametrize("split", [True, pytest.param(False, marks=slow)])
def test_idle_warpgroups_skip_their_work(split, fresh_rng):
    """skip_idle: the second compute warpgroup of a tile whose sequence ends in its first half
    (10 packed rows; 72 packed rows of the second sequence start in a tile of their own) walks
    the barriers only; every row still matches the reference, and the interpreter's race
    detector finds no race (the walk keeps every barrier phase of the ring)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from kernels_pallas.paged_attention.mosaic_prefill import prefill_attention_mosaic
    from kernels_pallas.rope import apply_rope
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 1, 2, 64, None, 0.2, True,
                               [(600, 5, 0), (130, 36, 0)])
    q_rot = apply_rope(q, md.q_positions, inv, 1.0)
    kw = dict(rotate_keys=True, attention_scaling=1.0, sm_scale=64 ** -0.5, skip_idle=True,
              interpret=plgpu.InterpretGPUParams(detect_races=True) if INTERPRET else False)
    if split:  # jitted: eagerly an XLA program an op of the kernel's preparation
        out = jax.jit(lambda *a: prefill_attention_split(*a, splits=2, min_steps=2, **kw))(
            q_rot, k, v, md, inv)
    else:
        out = jax.jit(lambda *a: prefill_attention_mosaic(*a, **kw))(q_rot, k, v, md, inv)
    _check(out, q, k, v, md, inv, "position_free")
    if INTERPRET:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
        assert not ipc.get_races().races_found, "race detector found a data race"


MIXED_CASES = [
    # a decode row and a prefill chunk over cached context, one kv head
    pytest.param(1, [(40, 1, 0), (100, 12, 0)], 1, id="decode+prefill", marks=slow),
    # decode rows, two prefill chunks, an empty sequence, GQA, partial rotary
    pytest.param(2, [(60, 1, 0), (200, 30, 0), (0, 1, 0), (0, 17, 5), (30, 0, 0)], 2,
                 id="two-prefills", marks=slow),
    # the same with one prefill slot: the step overflows to the Triton ragged kernel
    pytest.param(2, [(60, 1, 0), (200, 30, 0), (0, 1, 0), (0, 17, 5), (30, 0, 0)], 1,
                 id="overflow-to-ragged", marks=slow),
]


@pytest.mark.parametrize("kv_heads,specs,slots", MIXED_CASES)
def test_mixed_step_matches_reference(kv_heads, specs, slots, fresh_rng):
    """Decode rows and prefill chunks in one step (implementation="mixed", its defaults: values
    read from the pages, so finite pads)."""
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, kv_heads, 2, 64, 32, 0.2, True, specs)
    k, v = _finite_pads(fresh_rng, k, v)
    out = paged_attention(q, k, v, md, inv, kv_mode="position_free", implementation="mixed",
                          interpret=INTERPRET, kernel_options={"prefill_seqs": slots})
    _check(out, q, k, v, md, inv, "position_free")


def test_compaction_keeps_rows_in_place(fresh_rng):
    _, _, _, md, _ = _inputs(fresh_rng, jnp.bfloat16, 1, 2, 64, None, 0.0, False,
                             [(16, 1, 0), (0, 5, 0), (32, 1, 0), (0, 7, 0)])
    compact, count, prefill_row = compact_prefill(md, 3)
    cu = np.asarray(md.cu_q_lens)
    assert int(count) == 2
    np.testing.assert_array_equal(np.asarray(compact.q_bounds[0]), [cu[1], cu[3], 0])
    np.testing.assert_array_equal(np.asarray(compact.q_bounds[1]), [cu[2], cu[4], 0])
    assert np.asarray(compact.num_blocks)[2] == 0
    assert np.asarray(prefill_row).tolist() == [False] + [True] * 5 + [False] + [True] * 7
    q = jnp.arange(md.q_seq.shape[0] * 2, dtype=jnp.float32).reshape(-1, 1, 2)
    q_d, md_d = decode_batch(q, md)
    np.testing.assert_array_equal(np.asarray(q_d)[:, 0, 0], np.asarray(q)[cu[:-1], 0, 0])
    assert np.asarray(md_d.num_blocks).tolist() == [2, 0, 3, 0]


@pytest.mark.parametrize("splits", [4])
def test_mixed_compiled_path_lowers_for_cuda(splits, fresh_rng, monkeypatch):
    """The compiled mixed step (Mosaic prefill with and without the split, the decode kernel,
    the lax.cond to the overflow implementation) lowers for CUDA on this CPU-only machine."""
    from jax import export
    from kernels_pallas.paged_attention import mosaic_prefill_prep
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 2, 4, 128, None, 0.3, True,
                               [(40, 1, 0), (300, 61, 0), (0, 20, 5)])
    # Triton kernels cannot lower without a GPU here: XLA stands in for the overflow and for
    # the live-only gather (test_gather_live.py checks that one against the XLA gather)
    options = {"prefill_seqs": 2, "splits": splits, "overflow": "xla"}
    monkeypatch.setattr(mosaic_prefill_prep, "LIVE_GATHER", False)

    def step(q, k, v, md):
        return paged_attention(q, k, v, md, inv, kv_mode="position_free", sm_scale=0.1,
                               implementation="mixed", kernel_options=options,
                               max_position=512)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # no interpreter: lower for CUDA
    text = export.export(jax.jit(step), platforms=["cuda"])(q, k, v, md).mlir_module()
    assert text.count("mosaic_gpu") >= 2  # the prefill and the decode kernels


def test_step_plan_is_decided_on_the_host():
    """The engine passes each step's prefill count (step_options): the slots are fixed and the
    Mosaic path or the overflow is chosen before launch; other implementations are untouched."""
    from kernels_pallas.paged_attention.api import step_options
    from kernels_pallas.paged_attention.mosaic_mixed import MixedOptions
    base = MixedOptions(max_position=64)
    fits = step_options("mixed", base, tokens=8192, seqs=64, prefill_count=16)
    assert (fits.prefill_seqs, fits.prefill_fits) == (16, True)  # one slot per 512 rows
    over = step_options("mixed", base, tokens=8192, seqs=64, prefill_count=17)
    assert (over.prefill_seqs, over.prefill_fits) == (16, False)
    small = step_options("mixed", base, tokens=128, seqs=16, prefill_count=1)
    assert (small.prefill_seqs, small.prefill_fits) == (2, True)
    assert step_options("triton", "opts", tokens=128, seqs=16, prefill_count=9) == "opts"


@pytest.mark.parametrize("fits", [True, False])
def test_planned_step_holds_no_conditional(fits, fresh_rng, monkeypatch):
    """With the host's plan the traced GPU step has no lax.cond (XLA's GPU conditional syncs
    the host at each execution: once per layer); without one it keeps the device check."""
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 1, 2, 64, None, 0.0, False,
                               [(20, 1, 0), (40, 9, 0)])

    def primitives(**plan):  # XLA-level primitives of the step (kernel bodies not entered)
        def step(q, k, v, md):
            return paged_attention(q, k, v, md, inv, kv_mode="position_free",
                                   implementation="mixed", max_position=64,
                                   kernel_options={"overflow": "xla", **plan})
        return set(primitive_counts(jax.make_jaxpr(step)(q, k, v, md).jaxpr))

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the compiled path (traced only)
    names = primitives(prefill_seqs=1, prefill_fits=fits)
    assert "cond" not in names
    assert bool(names & KERNELS) == fits  # the Mosaic kernels, or only the XLA overflow
    assert "cond" in primitives(prefill_seqs=1)


def test_prefill_choice_falls_back_cleanly():
    """"auto" for GPU steps that may hold prefill chunks: the Mosaic mixed path for bf16/f16 with
    head_dim 64 or 128 (full or partial rotary), Triton ragged for Qwen3.5's head_dim 256 or
    float32, XLA where Triton cannot take the shapes either; on CPU XLA."""
    from kernels_pallas.paged_attention.api import choose_attention
    from kernels_pallas.paged_attention.problem import Problem

    def choose(dtype, head_dim, rotary=None, platform="gpu"):
        problem = Problem(heads=4, kv_heads=2, head_dim=head_dim,
                          rotary_half=(rotary or head_dim) // 2, dtype=jnp.dtype(dtype),
                          block_size=16, table_cols=4, max_position=64, platform=platform)
        impl, options = choose_attention(problem)
        return impl.name, options

    assert choose(jnp.bfloat16, 128, platform="cpu")[0] == "xla"
    name, options = choose(jnp.bfloat16, 128)
    assert name == "mixed" and options.max_position == 64  # the decode rows' table bound
    assert choose(jnp.float16, 64, 32)[0] == "mixed"
    assert choose(jnp.bfloat16, 256, 64)[0] == "triton"  # Qwen3.5 attention
    assert choose(jnp.float32, 128)[0] == "triton"
    assert choose(jnp.bfloat16, 96)[0] == "xla"


from attention_test_base import CASES as SHARED_CASES, AttentionKernelTests  # noqa: E402
from attention_test_base import pytest_generate_tests  # noqa: E402,F401 (the hook)


class TestMixed(AttentionKernelTests):
    """The shared kernel cases it takes (bf16/f16, head_dim 64/128), compiled or with
    --run-slow (interpreted, each costs about as much as the Mosaic prefill's); the engine-shaped
    cases above keep the path in the default run."""

    implementation = "mixed"
    slow_cases = tuple(c.name for c in SHARED_CASES)
    # Its decode rows run the registry's decode kernel (mosaic_decode for these shapes), whose
    # contract is finite pad slots (mosaic_decode.py; the engine zeroes each page it hands out
    # before first use, serving/cache/page_zeroing.py): with NaN pads the decode-only case failed here
    # exactly as mosaic_decode alone does on those inputs. The prefill part zeroes pads itself
    # (test_gather_live.py, the engine-shaped cases above, which keep NaN pads).
    nan_pads = False


def test_gqa_packing_maps_heads_to_rows_and_back(fresh_rng):
    """pack_gqa: row t * G + g of kv column k holds head k * G + g of token t, with token t's
    position and window; a sequence's rows scale by G; unpack_gqa inverts it."""
    from kernels_pallas.paged_attention.mosaic_prefill_split import pack_gqa, unpack_gqa
    _, _, _, md, _ = _inputs(fresh_rng, jnp.bfloat16, 2, 3, 64, None, 0.0, False,
                             [(30, 5, 0), (0, 3, 0)])
    tokens, heads, group = 8, 6, 3
    q = jnp.asarray(fresh_rng.standard_normal((tokens, heads, 4)), jnp.float32)
    qp, mp = pack_gqa(q, md, group)
    assert qp.shape == (tokens * group, heads // group, 4)
    for t, g, k in ((0, 0, 0), (3, 2, 1), (7, 1, 0)):
        np.testing.assert_array_equal(qp[t * group + g, k], q[t, k * group + g])
        assert int(mp.q_positions[t * group + g]) == int(md.q_positions[t])
        assert int(mp.q_window_start[t * group + g]) == int(md.q_window_start[t])
    np.testing.assert_array_equal(np.asarray(mp.q_bounds[1]), np.asarray(md.cu_q_lens[1:]) * group)
    np.testing.assert_array_equal(unpack_gqa(qp, group), q)


def test_tile_schedules_hold_no_while_loop():
    """The per-layer tile schedules of the ragged and Mosaic prefill kernels look up each tile's
    sequence without a while loop (jnp.searchsorted's default: a loop of small kernels per level,
    once per attention layer), and give the tiles a brute-force count gives."""
    from kernels_pallas.paged_attention import triton_ragged

    cu = np.array([0, 5, 5, 70, 200], np.int32)
    jaxpr = str(jax.make_jaxpr(lambda c: triton_ragged.tile_schedule(c, 200, 64))(cu))
    assert "while" not in jaxpr
    seq, start = map(np.asarray, triton_ragged.tile_schedule(cu, 200, 64))
    want = [(s, t) for s in range(4) for t in range(cu[s], cu[s + 1], 64)]
    got = [(int(a), int(b)) for a, b in zip(seq, start) if a >= 0]
    assert got == want


def test_split_merge_matches_brute_force(fresh_rng):
    """merge_split (rows gathered from their tile's partials) vs a float64 loop over the split
    entries of a real tile schedule: each owned row is the exp2(lse)-weighted mean of its tile's
    used partials, rows of no tile are zero."""
    from kernels_pallas.paged_attention.mosaic_prefill_prep import (BLOCK_KV, TILE_Q, TILE_Q0,
                                                                    TILE_Q1, TILE_SEQ,
                                                                    TILE_START, key_positions,
                                                                    tile_schedule)
    from kernels_pallas.paged_attention.mosaic_prefill_split import merge_split, split_schedule
    _, _, _, md, _ = _inputs(fresh_rng, jnp.bfloat16, 1, 2, 64, None, 0.0, False,
                             [(700, 20, 0), (0, 3, 0), (40, 0, 0), (300, 150, 0)])
    tokens, splits = md.q_seq.shape[0], 3
    n_pad = -(-md.block_tables.shape[1] * 16 // BLOCK_KV) * BLOCK_KV
    sched = tile_schedule(md, key_positions(md, 16, n_pad), tokens)
    sched, used = split_schedule(sched, splits, 2)
    part = fresh_rng.standard_normal((sched.shape[0], 2, TILE_Q, 8)).astype(np.float32)
    lse = (3 * fresh_rng.standard_normal((sched.shape[0], 2, TILE_Q))).astype(np.float32)
    got = np.asarray(merge_split(jnp.asarray(part), jnp.asarray(lse), used, sched, splits,
                                 tokens))
    sc, used = np.asarray(sched), np.asarray(used)
    want = np.zeros((tokens, 2, 8))
    for tile in range(sc.shape[0] // splits):
        e = [tile * splits + j for j in range(splits) if used[tile * splits + j]]
        seq, start, q0, q1 = sc[tile * splits, [TILE_SEQ, TILE_START, TILE_Q0, TILE_Q1]]
        for r in range(TILE_Q):
            if seq < 0 or not q0 <= start + r < q1 or not e:
                continue
            w = np.exp2(lse[e, :, r].astype(np.float64))  # [E, H]
            want[start + r] = (w[..., None] * part[e, :, r]).sum(0) / w.sum(0)[:, None]
    assert np.any(want != 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_step_without_decode_rows_leaves_the_decode_kernel_out(fresh_rng, monkeypatch):
    """A small step whose sequences all have >= 2 query rows (the cached-span request), planned
    on the host, traces no decode kernel: one Mosaic prefill kernel and the gather per layer;
    a step with a decode row, a large one, or an unknown decode count keeps the decode part."""
    from kernels_pallas.paged_attention.api import step_options
    from kernels_pallas.paged_attention.mosaic_mixed import MixedOptions
    base = MixedOptions(max_position=64)
    plan = lambda t, p, d: step_options("mixed", base, tokens=t, seqs=8, prefill_count=p,  # noqa
                                        decode_count=d)
    assert not plan(128, 1, 0).decode_rows
    assert plan(128, 1, 1).decode_rows and plan(128, 1, None).decode_rows
    assert plan(1024, 1, 0).decode_rows  # a large step amortises the empty decode part
    assert not plan(128, 3, 0).prefill_fits and plan(128, 3, 0).decode_rows  # overflow
    q, k, v, md, inv = _inputs(fresh_rng, jnp.bfloat16, 2, 2, 128, None, 0.0, False,
                               [(300, 40, 0), (0, 9, 0)])

    def kernels(**options):  # Pallas / Mosaic GPU kernels the traced step calls
        def step(q, k, v, md):
            return paged_attention(q, k, v, md, inv, kv_mode="position_free",
                                   implementation="mixed", max_position=512,
                                   kernel_options={"overflow": "xla", "prefill_fits": True,
                                                   "prefill_seqs": 2, **options})
        counts = primitive_counts(jax.make_jaxpr(step)(q, k, v, md).jaxpr)
        return sum(counts[k] for k in KERNELS)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the compiled path (traced only)
    with_decode, without = kernels(), kernels(decode_rows=False)
    assert without == with_decode - 1 and without >= 1, (with_decode, without)

