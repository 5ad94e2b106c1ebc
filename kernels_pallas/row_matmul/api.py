"""Entry points of the few-row matmuls (a decode step's MLP; triton_rows.py says how) and the
shapes they take, checked with errors that name what does not fit (reference.py: the XLA form
they replace, what runs where they do not fit)."""

from __future__ import annotations

from kernels_pallas.row_matmul import reference, triton_rows

MAX_ROWS = 64  # the products keep every row of a column block in registers
BLOCK_N, BLOCK_K = 32, 128  # output columns a program, contraction rows a loop step (at most)


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


def norm_swiglu(x, norm_w, w_gate_up, *, eps: float, unit_offset: bool,
                interpret: bool = False):
    """silu(h W_gate) * (h W_up) of h = layers.rms_norm(x, norm_w, eps, unit_offset=...):
    x [M, E], norm_w [E], w_gate_up [E, 2F] -> [M, F] in x's dtype (the fused MLP's first half,
    with its norm)."""
    m, e = x.shape
    if norm_w.shape != (e,) or w_gate_up.ndim != 2 or w_gate_up.shape[0] != e \
            or w_gate_up.shape[1] % 2:
        raise ValueError(f"norm_swiglu: x {x.shape}, norm_w {norm_w.shape}, w_gate_up "
                         f"{w_gate_up.shape} (want [M, E], [E], [E, 2F])")
    _check("norm_swiglu", m, e, w_gate_up.shape[1] // 2)
    return triton_rows.norm_swiglu(x, norm_w, w_gate_up.astype(x.dtype), eps=eps,
                                   unit_offset=unit_offset, block_n=block(w_gate_up.shape[1] // 2,
                                                                          BLOCK_N),
                                   block_k=block(e, BLOCK_K), interpret=interpret)


def matmul_residual(y, w, residual, *, interpret: bool = False):
    """residual + y W: y [M, K], w [K, N], residual [M, N] -> [M, N] in residual's dtype."""
    m, k = y.shape
    if w.ndim != 2 or w.shape[0] != k or residual.shape != (m, w.shape[1]):
        raise ValueError(f"matmul_residual: y {y.shape}, w {w.shape}, residual "
                         f"{residual.shape} (want [M, K], [K, N], [M, N])")
    _check("matmul_residual", m, k, w.shape[1])
    return triton_rows.matmul_residual(y, w.astype(y.dtype), residual,
                                       block_n=block(w.shape[1], BLOCK_N),
                                       block_k=block(k, BLOCK_K), interpret=interpret)


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
