"""Small pure-JAX building blocks shared by the model families (shapes: configs/model_config.py)."""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.row_matmul import api as row_matmul
from kernels_pallas.sharding import tp_mesh

# A step of at most row_matmul.MAX_ROWS rows (a decode step) runs each block's MLP, with its norm
# and its residual add, as two kernels (kernels_pallas/row_matmul: the norm with the gate/up
# product and SwiGLU, the down product with the residual), where XLA runs ~5 a block; fused
# weights, one device (interpreted on a CPU), both model families. Within the float32 sums'
# order of the XLA form (tests/test_row_matmul.py). Off until compiled and timed on a GPU (read
# when a step is traced).
MLP_ROW_KERNEL = False


# ... and each mixer's norm in its input projection's kernel (row_matmul.norm_matmul) and its
# output projection with the residual add (matmul_residual): `pre_norm` hands the mixer a Normed
# instead of the normed rows, its projections go through `project`, its output projection
# through `out_projection`, and the block adds it with `add_residual`. Off until compiled and
# timed on a GPU.
MIXER_ROW_KERNELS = False


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _kernels_take(rows: int, *widths: int) -> bool:
    return tp_mesh() is None and row_matmul.fits(rows, *widths)


def mlp_in_kernels(x, norm_w, w_gate_up, w_down, eps: float, unit_offset: bool):
    """x + the SwiGLU MLP of rms_norm(x) (fused weights) in row_matmul's kernels, or None where
    they do not run: MLP_ROW_KERNEL off, rows or widths they do not take, tensor parallel."""
    if not (MLP_ROW_KERNEL and _kernels_take(x.shape[0], *w_down.shape)):
        return None
    return row_matmul.mlp(x, norm_w, w_gate_up, w_down, eps=eps, unit_offset=unit_offset,
                          interpret=_interpret())


class Normed(NamedTuple):
    """rms_norm(x, weight) not computed yet: a mixer's input projection takes the norm into its
    kernel (`project`). `value()` computes it (what any other use of the rows reads)."""
    x: jax.Array
    weight: jax.Array
    eps: float
    unit_offset: bool

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype

    def value(self):
        return rms_norm(self.x, self.weight, self.eps, unit_offset=self.unit_offset)


class Projected(NamedTuple):
    """y @ w not computed yet: the block adds it to its residual in one kernel (`add_residual`)."""
    y: jax.Array
    w: jax.Array


def pre_norm(x, weight, eps: float, *, unit_offset: bool = False, fused: bool = False):
    """A block's norm before its mixer: rms_norm(x), or (MIXER_ROW_KERNELS, the mixer's fused
    weights: an engine's, not a training forward's, rows the kernels take, one device) a Normed
    its projections take into their kernels."""
    if MIXER_ROW_KERNELS and fused and _kernels_take(*x.shape):
        return Normed(x, weight, eps, unit_offset)
    return rms_norm(x, weight, eps, unit_offset=unit_offset)


def normed(h):
    """The normed rows of `pre_norm`'s result."""
    return h.value() if isinstance(h, Normed) else h


def project(h, w):
    """h [T, E] (rows or a Normed) @ w [E, N] -> [T, N] in h's dtype: a Normed's norm and the
    product in one kernel (row_matmul.norm_matmul) where it takes the widths."""
    if isinstance(h, Normed) and _kernels_take(h.shape[0], h.shape[1], w.shape[1]):
        return row_matmul.norm_matmul(h.x, h.weight, w, eps=h.eps, unit_offset=h.unit_offset,
                                      interpret=_interpret())
    return jnp.einsum("te,en->tn", normed(h), w)


def project_heads(h, w):
    """h [T, E] (rows or a Normed) @ w [E, N, D] -> [T, N, D]: a Normed through `project` of the
    [E, N*D] weights (its norm in the kernel), rows by the einsum."""
    if isinstance(h, Normed):
        e, n, d = w.shape
        return project(h, w.reshape(e, n * d)).reshape(-1, n, d)
    return jnp.einsum("te,end->tnd", h, w)


def out_projection(y, w, h):
    """A mixer's output y [T, K] @ w [K, E]: a Projected the block adds in one kernel where its
    input `h` was a Normed and the kernel takes the widths, else the product."""
    if isinstance(h, Normed) and _kernels_take(y.shape[0], *w.shape):
        return Projected(y, w)
    return jnp.einsum("tk,ke->te", y, w)


def heads_projection(attn, wo, h):
    """An attention mixer's output attn [T, H, D] @ wo [H, D, E]: `heads_out`, or where its input
    `h` was a Normed, `out_projection` of the [T, H*D] rows."""
    if not isinstance(h, Normed):
        return heads_out(attn, wo)
    nh, d, e = wo.shape
    return out_projection(attn.reshape(attn.shape[0], nh * d), wo.reshape(nh * d, e), h)


def add_residual(x, out):
    """x + a mixer's output (an array, or a Projected: row_matmul.matmul_residual)."""
    if isinstance(out, Projected):
        return row_matmul.matmul_residual(out.y, out.w, x, interpret=_interpret())
    return x + out


def float32_matmuls(params):
    """Trace context for a forward over `params`: all-float32 params -> every dot at IEEE float32
    ("highest"; a GPU's default for float32 dots is TF32, ~1e-3 relative per matmul: 3e-2 on the
    Qwen3.5 fixture's logits on the H200, where HF parity asks 1e-4), as the kernels already do
    for float32 operands; other dtypes -> the default (tensor-core math, float32 accumulation)."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    if leaves and all(x.dtype == jnp.float32 for x in leaves):
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def exact_float32(forward):
    """Decorator: `forward(params, ...)` traced under `float32_matmuls(params)` (the signature is
    kept for jax.jit's static_argnames)."""
    @functools.wraps(forward)
    def traced(params, *args, **kwargs):
        with float32_matmuls(params):
            return forward(params, *args, **kwargs)
    return traced


def rms_norm(x, weight, eps: float, *, unit_offset: bool = False):
    """RMSNorm as HF computes it. x [..., E], weight [E] -> [..., E] in x's dtype.

    Llama: normalise in float32, cast to x's dtype, then multiply by weight.
    unit_offset (Qwen3.5 / Gemma): multiply by (1 + weight) in float32, then cast.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def swiglu_mlp(x, w_gate, w_up, w_down):
    """x [T, E], w_gate/w_up [E, F], w_down [F, E] -> [T, E]: down(silu(gate(x)) * up(x))."""
    gate = jnp.einsum("te,ef->tf", x, w_gate)  # [T, F]
    up = jnp.einsum("te,ef->tf", x, w_up)  # [T, F]
    return jnp.einsum("tf,fe->te", jax.nn.silu(gate) * up, w_down)  # [T, E]


def embed(tokens, table):
    """tokens [T] int32, table [V, E] -> [T, E]; out-of-range ids (bucket padding) are clipped."""
    return jnp.take(table, tokens, axis=0, mode="clip")


# The LM head's rows padded to LOGITS_PAD_TO when PAD_ROWS_FROM <= N < LOGITS_PAD_TO. The head
# (benchmarks/lm_head_forms.py, H100, s30-s31) is one 0.17 ms Triton GEMM fusion at 8-32 rows as
# stored, padded no faster, and so is it in the engine's steps (the "0.71 ms cuBLAS head" of
# s28-s31b's bench steps was span_step_work's own 1,024-row head). Off: no gain measured.
PAD_LOGITS_ROWS = False
PAD_ROWS_FROM, LOGITS_PAD_TO = 8, 64


def _head(spec, x, table):
    """einsum(spec) of rows x [N, E] and an LM head table in float32, rows padded (above)."""
    n = x.shape[0]
    if PAD_LOGITS_ROWS and PAD_ROWS_FROM <= n < LOGITS_PAD_TO:
        x = jnp.pad(x, ((0, LOGITS_PAD_TO - n), (0, 0)))
        return jnp.einsum(spec, x, table, preferred_element_type=jnp.float32)[:n]
    return jnp.einsum(spec, x, table, preferred_element_type=jnp.float32)


def logits_from_hidden(x, lm_head_ev):
    """x [N, E], lm_head [E, V] -> logits [N, V] float32 (accumulated in float32)."""
    return _head("ne,ev->nv", x, lm_head_ev)


def tied_logits(x, embed_ve):
    """x [N, E], the embedding [V, E] as the LM head -> logits [N, V] float32. Contracts E of
    the table as stored: spelled `embed.T` then `ne,ev`, a one-row step on CPU materialised the
    transposed 113 MB table each step (SmolLM2-135M: 28 ms of a 60 ms step, vs 6 ms)."""
    return _head("ne,ve->nv", x, embed_ve)


def heads_out(attn, wo):
    """attn [T, H, D], wo [H, D, E] -> [T, E] as one [T, H*D] x [H*D, E] product. Spelled as a
    two-axis contraction ("thd,hde"), XLA on CPU copied wo into [D, H, E] order at every step
    (SmolLM2-135M, 30 layers: 30 ms per step vs 7 ms at 16 rows, 27 vs 3 ms at one row)."""
    h, d, e = wo.shape
    return jnp.einsum("tk,ke->te", attn.reshape(attn.shape[0], h * d), wo.reshape(h * d, e))
