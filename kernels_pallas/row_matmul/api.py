"""Entry points of the few-row matmuls (a decode step's MLP; triton_rows.py says how) and the
shapes they take, checked with errors that name what does not fit (reference.py: the XLA form
they replace, what runs where they do not fit)."""

from __future__ import annotations

from kernels_pallas.row_matmul import reference, triton_rows

MAX_ROWS = 64  # the products keep every row of a column block in registers
# Each kernel's launch options (at most: `block` fits them to a width): output columns a program,
# contraction rows a loop step, warps, pipeline stages, and for the residual product the K
# slices a column block is split into (float32 partials an XLA fusion adds). The best of
# `row_matmul_bench --sweep` at Qwen3.5-0.8B's widths and 8 rows (H100: per layer 14.1 / 12.6 /
# 6.5-7.2 us against XLA's 15.4 / 15.0 / 7.7-8.1; benchmarks/RESULTS.md, Known gaps).
OPTIONS = {
    "norm_matmul": dict(block_n=32, block_k=256, num_warps=4, num_stages=3),
    "norm_swiglu": dict(block_n=16, block_k=256, num_warps=4, num_stages=3),
    "matmul_residual": dict(block_n=16, block_k=256, num_warps=4, num_stages=3, split_k=2),
}


def block(width: int, most: int) -> int | None:
    """The largest power of two <= `most` (and >= 16, a Triton dot's least) dividing `width`."""
    b = most
    while b >= 16 and width % b:
        b //= 2
    return b if b >= 16 else None


def fits(rows: int, *dims: int) -> bool:
    """Whether a product of `rows` rows runs in the kernels: 8 <= rows <= MAX_ROWS, a power of
    two (a decode bucket), and each of `dims` (contraction and output widths) a multiple of 16."""
    return (8 <= rows <= MAX_ROWS and rows & (rows - 1) == 0
            and all(block(d, 16) for d in dims))


def _check(name, rows, *dims):
    if not fits(rows, *dims):
        raise ValueError(f"{name}: {rows} rows and widths {dims} do not fit the kernel (rows a "
                         f"power of two in 8..{MAX_ROWS}, widths multiples of 16)")


def norm_matmul(x, norm_w, w, *, eps: float, unit_offset: bool, swiglu: bool = False,
                interpret: bool = False):
    """h W of h = rms_norm(x, norm_w, eps) (Qwen3.5's (1 + w) where `unit_offset`): x [M, E],
    norm_w [E], w [E, N] -> [M, N] in x's dtype (a mixer's input projection with its norm);
    `swiglu`: w = [W_gate | W_up], silu(h W_gate) * (h W_up) [M, N / 2] (the fused MLP's first
    half)."""
    m, e = x.shape
    name = "norm_swiglu" if swiglu else "norm_matmul"
    if norm_w.shape != (e,) or w.ndim != 2 or w.shape[0] != e or (swiglu and w.shape[1] % 2):
        raise ValueError(f"{name}: x {x.shape}, norm_w {norm_w.shape}, w {w.shape} (want "
                         f"[M, E], [E], [E, {'2F' if swiglu else 'N'}])")
    n = w.shape[1] // 2 if swiglu else w.shape[1]
    _check(name, m, e, n)
    o = OPTIONS[name]
    return triton_rows.norm_matmul(x, norm_w, w.astype(x.dtype), eps=eps,
                                   unit_offset=unit_offset, swiglu=swiglu,
                                   block_n=block(n, o["block_n"]), block_k=block(e, o["block_k"]),
                                   num_warps=o["num_warps"], num_stages=o["num_stages"],
                                   interpret=interpret)


def norm_swiglu(x, norm_w, w_gate_up, *, eps: float, unit_offset: bool,
                interpret: bool = False):
    """norm_matmul(..., swiglu=True): x [M, E], norm_w [E], w_gate_up [E, 2F] -> [M, F]."""
    return norm_matmul(x, norm_w, w_gate_up, eps=eps, unit_offset=unit_offset, swiglu=True,
                       interpret=interpret)


def matmul_residual(y, w, residual, *, interpret: bool = False):
    """residual + y W: y [M, K], w [K, N], residual [M, N] -> [M, N] in residual's dtype."""
    m, k = y.shape
    if w.ndim != 2 or w.shape[0] != k or residual.shape != (m, w.shape[1]):
        raise ValueError(f"matmul_residual: y {y.shape}, w {w.shape}, residual "
                         f"{residual.shape} (want [M, K], [K, N], [M, N])")
    _check("matmul_residual", m, k, w.shape[1])
    o = OPTIONS["matmul_residual"]
    split = split_k(k, o["split_k"])
    return triton_rows.matmul_residual(y, w.astype(y.dtype), residual,
                                       block_n=block(w.shape[1], o["block_n"]),
                                       block_k=block(k // split, o["block_k"]),
                                       num_warps=o["num_warps"], num_stages=o["num_stages"],
                                       split_k=split, interpret=interpret)


def split_k(k: int, most: int) -> int:
    """The most K slices (<= `most`, a power of two) whose width is a multiple of 16 (a dot's
    least): 1 where none. (S slices of 16 k-multiples: 16 S divides k, `block`'s search.)"""
    b = block(k, 16 * most)
    return b // 16 if b else 1


def mlp(x, norm_w, w_gate_up, w_down, *, eps: float, unit_offset: bool,
        implementation: str = "triton", interpret: bool = False):
    """x + the SwiGLU MLP of RMSNorm(x) (fused weights: w_gate_up [E, 2F] = [W_gate | W_up],
    w_down [F, E]). implementation "triton": two kernels, norm_swiglu then matmul_residual (the
    down product); "xla": reference.mlp."""
    if implementation == "xla":
        return reference.mlp(x, norm_w, w_gate_up, w_down, eps=eps, unit_offset=unit_offset)
    if implementation != "triton":
        raise ValueError(f"row_matmul.mlp: implementation must be 'triton' or 'xla', got "
                         f"{implementation!r}")
    act = norm_swiglu(x, norm_w, w_gate_up, eps=eps, unit_offset=unit_offset,
                      interpret=interpret)
    return matmul_residual(act, w_down, x, interpret=interpret)
