"""The Mosaic GPU gated delta kernels (intra_mosaic.py, output_mosaic.py; implementations
"mosaic_intra" and "mosaic").

On CPU its kernels run under the Mosaic GPU interpreter, whose buffers start as NaN (unwritten
outputs show); MINIPIC_COMPILED=1 compiles them for the GPU instead. Its two numerical pieces are
checked alone in one-CTA harness kernels (the exact segment sums after a hard reset, the
block-nilpotent inverse on correlated keys), then the whole kernel against a float64 solve, the
Mosaic output kernel (output_mosaic.py) against the float64 formula, the prefill through api.py
against the float64 recurrence, what they reject, and the lowering for CUDA at the real layer
shape (T = 32768, 16 heads, D = 128) on this CPU-only machine.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.gated_delta import api, intra_mosaic, reference

INTERPRET = os.environ.get("MINIPIC_COMPILED") != "1"
C = intra_mosaic.CHUNK
BF16 = jnp.bfloat16


def _harness(body, ins, out_shapes):
    """Run body(*in_smem, ops) -> [arrays] in one CTA (ops: intra_mosaic.Operands): inputs
    [64] / [64, 64] float32 by TMA into SMEM, outputs stored to SMEM and back by TMA."""
    def kernel(*refs):
        n_in, n_out = len(ins), len(out_shapes)
        in_refs, out_refs = refs[:n_in], refs[n_in:n_in + n_out]
        in_smem, out_smem = refs[n_in + n_out:2 * n_in + n_out], refs[2 * n_in + n_out:-4]
        ops, bar = intra_mosaic.Operands.of(*refs[-4:-1], regs_a=not INTERPRET), refs[-1]
        for src, dst in zip(in_refs, in_smem):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)
        for dst, val in zip(out_smem, body(*in_smem, ops)):
            dst[...] = val
        plgpu.commit_smem()
        for src, dst in zip(out_smem, out_refs):
            plgpu.copy_smem_to_gmem(src, dst)
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel, out_type=[jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes],
        scratch_types=([plgpu.SMEM(x.shape, jnp.float32) for x in ins]
                       + [plgpu.SMEM(s, jnp.float32) for s in out_shapes]
                       + intra_mosaic.Operands.scratch()
                       + [plgpu.Barrier(num_arrivals=len(ins))]),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if INTERPRET else None)
    return [np.asarray(x, np.float64) for x in call(*map(jnp.asarray, ins))]


def _reset_gates(rng, rows=C):
    """Each 64-row chunk: tokens before a random row in [4, 32) decay by -50 .. -250 each, the
    rest by -0.001 .. -0.05 (tests/test_gated_delta_decay_precision.py's reset)."""
    end = rng.integers(4, 32, rows // C).repeat(C)
    big = np.arange(rows) % C < end
    return np.where(big, -rng.uniform(50, 250, rows), -rng.uniform(0.001, 0.05, rows))


@pytest.mark.parametrize("tiles", [4, 2])
def test_segment_sums_are_exact_after_a_reset(fresh_rng, tiles):
    """seg[i, j] (g over (j, i]), gc and the sums to the chunk end within 8 eps32 of each
    segment's own size: after |gc| ~ 5000 a difference of cumsums is off by ~ulp(4096) = 5e-4,
    hundreds of times more on the small segments behind the reset. Four operand tiles (the
    solve) or two (the output kernel)."""
    g = _reset_gates(fresh_rng).astype(np.float32)

    def body(gates, ops):
        gc, to_end, seg = intra_mosaic.exponents(gates, ops.tiles[:tiles])
        return seg, gc, to_end
    gates = np.stack([g, np.zeros_like(g)])
    seg, gc, to_end = _harness(body, [gates], [(C, C), (C,), (C,)])
    g64 = g.astype(np.float64)
    cum = np.cumsum(g64)
    want_seg = np.tril(cum[:, None] - cum[None, :], -1)  # float64: exact enough
    for got, want in ((np.tril(seg, -1), want_seg), (gc, cum), (to_end, cum[-1] - cum)):
        np.testing.assert_array_less(np.abs(got - want), 8 * 2.0 ** -24 * np.abs(want) + 1e-30)


def _correlated_a(rng):
    """A = tril(beta K K^T Gamma, -1) for unit keys around one shared direction (entries up to
    ~0.9: the regime where a whole-tile nilpotent product would cancel catastrophically)."""
    base = rng.standard_normal(64)
    k = base + 0.6 * rng.standard_normal((C, 64))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0.3, 1.0, C)
    cum = np.cumsum(-rng.uniform(0.0, 0.05, C))
    return np.tril(beta[:, None] * (k @ k.T) * np.exp(cum[:, None] - cum[None, :]), -1)


@pytest.mark.parametrize("passes,tol", [(3, 1e-3), (1, 8e-3)])
def test_unit_lower_inverse_on_correlated_keys(fresh_rng, passes, tol):
    """(I + A)^-1 by the block-nilpotent product against float64, relative to its largest
    entry: with three-pass block products well under the bf16 rounding the kernel applies to
    it next (measured 0.8 .. 2.8e-4), with one-pass block products (block_passes=1, the Triton
    kernel's bf16 block substitution) within 2 eps_bf16 (measured 3.5 .. 3.8e-3). One-pass
    products throughout, diagonal blocks included, measured 5 .. 9e-2 and fail both."""
    a = _correlated_a(fresh_rng)
    def body(a_ref, ops):
        a_regs = plgpu.load(a_ref, layout=plgpu.Layout.WGMMA, optimized=False)
        return [intra_mosaic.unit_lower_inverse(a_regs, ops, passes)]
    [x] = _harness(body, [a.astype(np.float32)], [(C, C)])
    want = np.linalg.inv(np.eye(C) + a.astype(np.float32).astype(np.float64))
    err = np.abs(x - want).max() / np.abs(want).max()
    assert err < tol, f"relative error {err:.2e} with passes={passes}"


def _inputs(rng, n, t, hk, hv, d, dtype=BF16, reset=True):
    """q, k (unit rows; keys around a shared direction), v, g, beta, state0; g with a reset per
    chunk (`_reset_gates`) or, reset=False, mild decays -0.001 .. -0.3 per token."""
    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.standard_normal((n, t, hk, d)))
    k = unit(rng.standard_normal((n, t, hk, d)) + 0.5 * rng.standard_normal(d))
    v = rng.standard_normal((n, t, hv, d))
    beta = rng.uniform(0.05, 1.0, (n, t, hv))
    g = np.stack([np.stack([_reset_gates(rng, t) for _ in range(hv)], -1) for _ in range(n)])
    if not reset:
        g = -rng.uniform(0.001, 0.3, (n, t, hv))
    s0 = rng.standard_normal((n, hv, d, d)).astype(np.float32)
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(g, jnp.float32),
            jnp.asarray(beta, dtype), s0)


def _intra_float64(k, v, g, beta):
    """W, U, KD, gc of each chunk in float64 (k already per value head): the UT system solved
    directly, exponents as float64 differences (exact enough)."""
    k, v, g, beta = (np.asarray(x, np.float64) for x in (k, v, g, beta))
    n, t, hv, _ = v.shape
    outs = [np.zeros_like(k), np.zeros_like(v), np.zeros_like(k), np.zeros_like(g)]
    for b, h, c0 in np.ndindex(n, hv, t // C):
        r = slice(c0 * C, (c0 + 1) * C)
        kc, vc, bc, gc = k[b, r, h], v[b, r, h], beta[b, r, h], np.cumsum(g[b, r, h])
        below = np.tril(np.ones((C, C), bool), -1)
        gamma = np.exp(np.where(below, gc[:, None] - gc, -np.inf))
        system = np.eye(C) + bc[:, None] * (kc @ kc.T) * gamma
        outs[0][b, r, h] = np.linalg.solve(system, kc * (bc * np.exp(gc))[:, None])
        outs[1][b, r, h] = np.linalg.solve(system, vc * bc[:, None])
        outs[2][b, r, h] = kc * np.exp(gc[-1] - gc)[:, None]
        outs[3][b, r, h] = gc
    return outs


@pytest.mark.parametrize("lean", [False, True])
def test_kernel_matches_float64(fresh_rng, lean):
    """W, U, KD and gc against the float64 solve (lean: KD stored through K's tile, the
    69 KB-SMEM kernel), two sequences of one chunk of mild decays
    (after a reset W ~ exp(gc) underflows float32: the segment sums have their own test above;
    GVA and two chunks with resets: the prefill test below), keys around a shared direction:
    W, U, KD within 2^-7 of each output's scale (bf16 roundings of Tinv, of the right-hand sides
    and of the stored result: ~2^-9 each), gc to float32 accuracy; every row written (the
    interpreter's buffers start as NaN)."""
    _, k, v, g, beta, _ = _inputs(fresh_rng, 2, C, 1, 1, 64, reset=False)
    got = intra_mosaic.intra_chunk_mosaic(k, v, g, beta, interpret=INTERPRET, lean=lean)
    want = _intra_float64(k.astype(jnp.float32), v.astype(jnp.float32), g,
                          beta.astype(jnp.float32))
    for name, a, b in zip(("w", "u", "kd", "gc"), got, want):
        a = np.asarray(a, np.float32)
        assert np.all(np.isfinite(a)), f"{name}: rows left unwritten"
        tol = 1e-6 * np.abs(b).max() if name == "gc" else 2.0 ** -7 * np.abs(b).max()
        np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=name)


@pytest.mark.slow  # ~3 s interpreted; the "mosaic" prefill below runs it in the default run
def test_output_kernel_matches_float64(fresh_rng):
    """output_mosaic against O = (scale Q exp(gc)) S + tril(scale Q K^T Gamma) V' in float64 on
    the same bf16 values, entering states in both layouts, GVA 2, two chunks with a reset: within
    2^-7 of the output's scale (bf16 roundings of the scaled queries, the masked scores and the
    stored output)."""
    from kernels_pallas.gated_delta import output_mosaic
    q, k, v_new, g, _, _ = _inputs(fresh_rng, 1, 2 * C, 1, 2, 64)
    states = jnp.asarray(fresh_rng.standard_normal((1, 2, 2, 64, 64)), BF16)  # [N, Hv, NT, Dk, Dv]
    qf, kf = (np.repeat(np.asarray(x, np.float64), 2, axis=2) for x in (q, k))
    vf, sf, gf = (np.asarray(x, np.float64) for x in (v_new, states, g))
    want = np.zeros_like(vf)
    below = np.tril(np.ones((C, C), bool))
    for h, c in np.ndindex(2, 2):
        r = slice(c * C, (c + 1) * C)
        gc = np.cumsum(gf[0, r, h])
        gamma = np.exp(np.where(below, gc[:, None] - gc, -np.inf))
        qs = qf[0, r, h] * 0.125
        want[0, r, h] = ((qs * np.exp(gc)[:, None]) @ sf[0, h, c]
                         + (qs @ kf[0, r, h].T * gamma) @ vf[0, r, h])
    for states_t in (False, True):
        s_in = jnp.swapaxes(states, -1, -2) if states_t else states
        got = output_mosaic.output_mosaic(q, k, g, v_new, s_in, scale=0.125, states_t=states_t,
                                          interpret=INTERPRET)
        got = np.asarray(got, np.float32)
        assert np.all(np.isfinite(got)), "rows left unwritten"
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -7 * np.abs(want).max(),
                                   err_msg=f"states_t={states_t}")


@pytest.mark.parametrize("impl", ["mosaic", pytest.param("mosaic_intra", marks=pytest.mark.slow)])
def test_prefill_matches_float64_after_a_reset(fresh_rng, impl):
    """api.prefill with the Mosaic kernels ("mosaic": solve and output; "mosaic_intra": the
    solve, then the Triton scan and output) against the float64 recurrence on the same bf16
    values: outputs, final state and a mid checkpoint within 2 eps_bf16 of the largest reference
    value, the bound the Triton pipeline meets (test_gated_delta_decay_precision.py)."""
    q, k, v, g, beta, s0 = _inputs(fresh_rng, 1, 2 * C, 1, 2, 64)
    out, final, cks = api.prefill(q, k, v, g, beta, s0, checkpoint_at=[C], chunk_size=C,
                                  implementation=impl, interpret=INTERPRET)
    wide = [np.asarray(x, np.float32) for x in (q, k, v, beta)]
    ref_out, ref_states = reference.gated_delta_reference(*wide[:3], np.asarray(g), wide[3], s0)
    eps = float(jnp.finfo(BF16).eps)
    for got, want in ((out, ref_out), (final, ref_states[:, -1]), (cks[:, 0], ref_states[:, C - 1])):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0,
                                   atol=2 * eps * np.abs(want).max())


@pytest.mark.slow  # ~5 s interpreted; compiled in the next device run
def test_ragged_prefill_matches_xla(fresh_rng):
    """api.ragged_prefill with both Mosaic kernels (the packed stream of ragged_triton.py, its
    unused worst-case chunks skipped: chunks_below) against the XLA ragged path on the same
    bf16 values: two sequences, one resumed at a chunk boundary (pos0 = 64) from its own state,
    outputs, final states and a checkpoint within 2 eps_bf16 of the largest XLA value."""
    q, k, v, g, beta, _ = _inputs(fresh_rng, 1, 2 * C, 1, 2, 64)
    cu, pos0 = np.array([0, 70, 110], np.int32), np.array([0, C], np.int32)
    s0 = jnp.asarray(fresh_rng.standard_normal((2, 2, 64, 64)), jnp.float32)
    ck = np.array([[C], [-1]], np.int32)
    rows = [x[0, :110] for x in (q, k, v, g, beta)]
    got, want = (api.ragged_prefill(*rows, cu, pos0, s0, checkpoint_at=ck, implementation=impl,
                                    interpret=INTERPRET) for impl in ("mosaic", "xla"))
    eps = float(jnp.finfo(BF16).eps)
    for a, b in zip(got, want):
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0,
                                   atol=2 * eps * np.abs(b).max())


def test_rejects_what_it_cannot_run(fresh_rng):
    q, k, v, g, beta, s0 = _inputs(fresh_rng, 1, C, 1, 1, 64)
    call = functools.partial(api.prefill, implementation="mosaic_intra", interpret=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with pytest.raises(ValueError, match="mosaic_intra.*bf16/f16"):
        call(*f32, g, beta, s0)
    with pytest.raises(ValueError, match="mosaic_intra.*chunk_size 64"):
        call(q, k, v, g, beta, s0, chunk_size=32)
    with pytest.raises(ValueError, match="mosaic_intra.*transition"):
        call(q, k, v, g, beta, s0, return_transition=True)
    with pytest.raises(ValueError, match="mosaic_intra.*sequential scan"):
        call(q, k, v, g, beta, s0, scan="tree")
    with pytest.raises(ValueError, match="intra_chunk_mosaic: needs bf16/f16"):
        api.ragged_prefill(f32[0][0], f32[1][0], f32[2][0], g[0], beta[0],
                           np.array([0, C], np.int32), np.zeros(1, np.int32), s0,
                           implementation="mosaic", interpret=True)
    with pytest.raises(ValueError, match="Dk, Dv multiples of 64"):
        intra_mosaic.intra_chunk_mosaic(k[..., :48], v, g, beta, interpret=True)
    with pytest.raises(ValueError, match="Dk, Dv multiples of 64 up to 128"):  # SMEM
        intra_mosaic.intra_chunk_mosaic(jnp.tile(k, 4), v, g, beta, interpret=True)
    from kernels_pallas.gated_delta import output_mosaic
    states = jnp.zeros((1, 1, 1, 64, 64), BF16)
    with pytest.raises(ValueError, match="output_mosaic: needs chunk 64, q/k/V'/states of one"):
        output_mosaic.output_mosaic(q, k, g, v.astype(jnp.float32), states, scale=0.1)
    with pytest.raises(ValueError, match="block_passes must be 1 or 3"):
        intra_mosaic.intra_chunk_mosaic(k, v, g, beta, interpret=True, block_passes=2)


def test_lowers_for_cuda_at_the_layer_shape():
    """Both compiled kernels (no interpreter) lower through Mosaic GPU for CUDA on this CPU-only
    machine at Qwen3.5-0.8B's GDN shape and a 32K prefill: layouts, TMA boxes, SMEM; the solve
    with a used-chunk count (the ragged path) and lean (KD through K's tile), the output kernel
    without."""
    from jax import export
    from kernels_pallas.gated_delta import output_mosaic
    s = jax.ShapeDtypeStruct
    x = s((1, 32768, 16, 128), BF16)
    gate = s((1, 32768, 16), jnp.float32)
    states = s((1, 16, 512, 128, 128), BF16)
    used = s((), jnp.int32)  # the ragged path's count of used chunks (chunks_below)
    intra = jax.jit(lambda k, v, g, b, n: intra_mosaic.intra_chunk_mosaic(k, v, g, b, used=n))
    lean = jax.jit(lambda k, v, g, b: intra_mosaic.intra_chunk_mosaic(k, v, g, b, lean=True))
    output = jax.jit(lambda q, k, g, v, st: output_mosaic.output_mosaic(
        q, k, g, v, st, scale=128 ** -0.5, states_t=True))
    for fn, args in ((intra, (x, x, gate, gate.update(dtype=BF16), used)),
                     (lean, (x, x, gate, gate.update(dtype=BF16))),
                     (output, (x, x, gate, x, states))):
        assert "mosaic_gpu" in export.export(fn, platforms=["cuda"])(*args).mlir_module()
