"""The maps' products of chunks of a packed gated delta stream (Pallas, Triton backend): a span
step's captured pieces' transitions A (affine.py) from the W, KD and decay their local pieces'
chunks already have in the stream (minipic_jax/models/qwen3_5_joint.py,
TRANSITIONS_IN_STREAM = False), with no rows, intra-chunk or output work of their own.

Grid (Hv, Dk / BV, M): program m walks chunks first[m] .. + count[m] with U = 0 (scan_fused.step:
V' = -W P, P = dl P + KD^T V', the scan's own arithmetic), from I or its row of a StateRows (a
long span's A so far), and stores P in the "kv" order. Called by ragged_triton's
packed_gated_delta after its state scan (`transitions=`); ragged._chunk_products is the XLA form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gated_delta import scan_fused, state_rows


def _transition_kernel(w_ref, kd_ref, dl_ref, first_ref, count_ref, *refs, n_chunks, chunk,
                       dot_dtype, layout, n_sources, block_v):
    # per transition (grid axis 2): the product of the maps (affine.py) of packed chunks
    # first .. first + count (another sequence's: its W, KD, decay), from I or, with n_sources,
    # row `sid` of a StateRows (kind, index, its sources' blocks: a long span's A so far);
    # out [M, Dk, BV] in the "kv" order. No V', no per-chunk states: the chunks' own sequence
    # stores those.
    out_ref = refs[-1]
    vk = layout == "vk"
    j = pl.program_id(1)
    sid = pl.program_id(2)
    start = jnp.minimum(first_ref[sid], n_chunks)
    end = jnp.minimum(start + jnp.maximum(count_ref[sid], 0), n_chunks)
    if n_sources:
        kind_ref, index_ref, *src_refs = refs[:-1]
        p0 = state_rows.load_tile(sid, kind_ref, index_ref, src_refs, j=j, block_v=block_v,
                                  transpose=vk)
    else:
        p0 = state_rows.eye_tile(out_ref.shape[1:], j=j, block_v=block_v)
        p0 = p0.T if vk else p0

    def body(c, p):
        return scan_fused.step(c, p, w_ref, None, kd_ref, dl_ref, None, chunk=chunk,
                               dot_dtype=dot_dtype, layout=layout)

    p = jax.lax.fori_loop(start, end, body, p0)
    out_ref[sid] = p.T if vk else p


def products(w, kd, dl, first, count, init, *, chunk, dot_dtype, options, interpret):
    """[M, Hv, Dk, Dk] float32: for each transition m the product of the maps of packed chunks
    first[m] .. + count[m] (`_transition_kernel`), from I (init None) or init's row m (a
    StateRows of M rows). w, kd [1, NC * C, Hv, Dk] and dl [Hv, NC] as the state scan reads
    them; options: fused_triton's (layout, block_v, scan_warps, scan_stages). Dk = Dv (a
    product is a state-sized block)."""
    _, t_len, hv, dk = w.shape
    layout, block_v = options["layout"], min(options["block_v"], dk)
    nc = t_len // chunk
    m = first.shape[0]
    seq_k = pl.BlockSpec((None, t_len, None, dk), lambda h, j, *_: (0, 0, h, 0))
    whole = lambda n: pl.BlockSpec((n,), lambda h, j, *_: (0,))  # noqa: E731
    in_specs = [seq_k, seq_k, pl.BlockSpec((None, nc), lambda h, j, *_: (h, 0)),
                whole(m), whole(m)]
    init_ops = ()
    if init is not None:
        in_specs += [whole(m), whole(m)] + [
            state_rows.source_spec(src, init.layer_of(i), dk, block_v)
            for i, src in enumerate(init.sources)]
        init_ops = (init.kind, init.index, *init.sources)
    return pl.pallas_call(
        functools.partial(_transition_kernel, n_chunks=nc, chunk=chunk, dot_dtype=dot_dtype,
                          layout=layout, n_sources=0 if init is None else len(init.sources),
                          block_v=block_v),
        grid=(hv, dk // block_v, m),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((m, None, dk, block_v), lambda h, j, *_: (0, h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((m, hv, dk, dk), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=options["scan_warps"],
                                             num_stages=options["scan_stages"]),
        interpret=interpret,
    )(w, kd, dl, jnp.asarray(first, jnp.int32), jnp.asarray(count, jnp.int32), *init_ops)[0]
