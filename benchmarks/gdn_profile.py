"""`minipic-bench gdn --profile`: where a gated delta prefill spends its time, kernel by kernel.

Each variant's device kernels (jax.profiler for ours, torch.profiler for fla's) are summed per
part of the chunked algorithm by kernel name:
  solve   the intra-chunk UT solve (W, U, KD): ours gdn_solve_mosaic / _intra_*_kernel; fla's
          chunk_scaled_dot_kkt, solve_tril, recompute_w_u;
  scan    the sequential state scan over chunks (V', the states entering each chunk): ours
          _scan_kernel / _restart_scan_kernel; fla's chunk_gated_delta_rule_fwd_h;
  output  O = Q S + tril(Q K^T) V': ours gdn_output_mosaic / _output_kernel; fla's chunk_fwd_o;
  glue    everything else (XLA fusions: casts, transposes, the gates' exp; fla's cumsum).
Next to each part, its floor at H100 rates (`floors`): the bytes it must move at 3.0 TB/s and
its tensor-core work at 790 TFLOP/s, so a part far above both is bound by latency (a chain of
dependent steps per CTA, too few CTAs in flight), not by the hardware's rates.
"""

from __future__ import annotations

PARTS = ("solve", "scan", "output", "glue")
HBM_BYTES_PER_S = 3.0e12  # H100 SXM, achievable (3.35 peak)
BF16_FLOP_PER_S = 790e12  # dense bf16 wgmma, achievable
_NAMES = {"solve": ("solve", "intra", "kkt", "recompute_w_u"),
          "scan": ("scan", "fwd_h", "kernel_h"),
          "output": ("output", "fwd_o", "kernel_o")}


def part_of(kernel_name: str) -> str:
    """The part of the algorithm a kernel belongs to, by its name (module doc)."""
    name = kernel_name.lower()
    for part, keys in _NAMES.items():
        if any(k in name for k in keys):
            return part
    return "glue"


def floors(tokens: int, heads: int, dim: int, block_passes: int = 3) -> dict:
    """ms floor of each part at H100 rates, {part: (memory ms, tensor ms)}, for bf16 q/k/v of
    [T, H, D] (Hk = Hv = H) and 64-token chunks, from what each kernel reads, writes and
    multiplies (the Mosaic kernels' products, intra_mosaic.py module doc)."""
    c, e = 64, 2
    tensor = tokens * heads * dim * e  # bytes of one [T, H, D] bf16 tensor
    states = (tokens // c) * heads * dim * dim * e  # the states entering each chunk, bf16
    per_chunk = {  # flops per (chunk, head)
        "solve": (2 * c * c * dim + 3 * 2 * c ** 3 + 6 * 3 * 2 * c * c * 16
                  + 4 * block_passes * 2 * c ** 3 + 2 * 2 * c * c * dim),
        "scan": 2 * 2 * c * dim * dim,  # W S, KD^T V'
        "output": 2 * 2 * c * c * dim + 2 * c * dim * dim}  # Q K^T, (Q K^T) V', Q S
    moved = {"solve": 5 * tensor + 12 * tokens * heads,  # K, V, gates in; W, U, KD, gc out
             "scan": 4 * tensor + states,  # W, U, KD in; V', states out
             "output": 4 * tensor + states}  # Q, K, V', states in; O out
    n = (tokens // c) * heads
    return {p: (1e3 * moved[p] / HBM_BYTES_PER_S, 1e3 * n * per_chunk[p] / BF16_FLOP_PER_S)
            for p in moved}


def profile_jax(fn, args, calls: int = 3) -> dict:
    """{part: ms per call} and the kernels by name (ms per call) of `calls` traced calls."""
    from benchmarks.timing import profile_kernels
    prof = profile_kernels(lambda: fn(*args), steps=calls, top=200)
    kernels = {k["name"]: k["ms_per_step"] for k in prof["top"]}
    return dict(parts=_by_part(kernels), kernels=kernels,
                busy_ms=prof["kernel_busy_ms_per_step"])


def profile_fla(call, calls: int = 3) -> dict:
    """The same for a torch call (fla's chunk_gated_delta_rule), through torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us:
            kernels[ev.key[:90]] = us / 1e3 / calls
    return dict(parts=_by_part(kernels), kernels=kernels, busy_ms=sum(kernels.values()))


def _by_part(kernels: dict) -> dict:
    parts = dict.fromkeys(PARTS, 0.0)
    for name, ms in kernels.items():
        parts[part_of(name)] += ms
    return parts


def line(label: str, prof: dict, floor: dict | None = None, top: int = 6) -> str:
    """One printed line: busy ms, each part's ms (and floor: memory / tensor ms), the top
    kernels."""
    parts = []
    for p in PARTS:
        f = "" if not floor or p not in floor else f" (floor {floor[p][0]:.3f}/{floor[p][1]:.3f})"
        parts.append(f"{p} {prof['parts'][p]:.3f}{f}")
    big = sorted(prof["kernels"].items(), key=lambda kv: -kv[1])[:top]
    names = ", ".join(f"{n[:48]} {ms:.3f}" for n, ms in big)
    return (f"{label} profile: busy {prof['busy_ms']:.3f} ms | " + " | ".join(parts)
            + f" | top: {names}")
