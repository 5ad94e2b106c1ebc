"""XLA's memory limit for a compiled GPU program, and how many KV blocks a default pool may take
so that every step program stays under it (issue 28: XLA's "Can't reduce memory use below
... by rematerialization" warning at warm-up).

How XLA (jaxlib 0.11.2) gets the limit it warns about:
  * jaxlib/py_client.cc, `PyClient::CompileAndLoadIfrtProgram`: every compile JAX asks for gets
    `ExecutableBuildOptions.device_memory_size` = the device allocator's `bytes_limit` (what
    `memory_stats()["bytes_limit"]` reports: fixed when the client starts, not the memory free at
    compile time; XLA falls back to 80% of the card only when it is 0).
  * xla/service/gpu/gpu_hlo_schedule.cc, `GetSchedulerMemoryLimit`: limit = (device_memory_size
    - io) * xla_gpu_memory_limit_slop_factor / 100 (default 95), io = every entry parameter +
    every output - the outputs aliased to a parameter (a donated buffer once).
  * xla/service/gpu/gpu_compiler.cc, `RunPostSchedulingPipelines`: `HloRematerialization` gets
    that limit; xla/hlo/transforms/simplifiers/hlo_rematerialization.cc, `RunImpl`, compares it
    with the entry computation's peak (its tracker counts neither parameters nor live-out
    buffers, `AllocatedSize`) plus the bytes of every output, aliased ones included, and warns
    when rematerialising cannot get below it.
So the donated KV pool counts twice (in io as a parameter, then as an output): a program fits
when temp + output <= slop% of (bytes_limit - argument - output + alias), and each pool block
costs (1 + slop%) of its bytes against the limit.

Not confirmed on a device: the one measurement (H100, 2026-12-05, benchmarks/
pool_reserve_probe.py at max_model_len 40,960, bytes_limit 59.38 GiB, pool 21.13 GiB) compiled
18 variants without a warning, where this reading gives the top one a 22.13 GiB limit against a
27.64 GiB peak; and with 14.96 GiB of weights among the arguments it can never give the 43.35
GiB the H100 ttft engine warned about (slop% of bytes_limit - weights is 42.4 GiB). XLA's base
is larger than bytes_limit there (the card's total fits both runs) or the aliased outputs are
not counted; kv_pool.CAP_BY_XLA_LIMIT stays off until the probe's VLOG run says which.
"""

from __future__ import annotations

from dataclasses import dataclass

SLOP_PERCENT = 95  # XLA's default xla_gpu_memory_limit_slop_factor (the engine passes none)


@dataclass(frozen=True)
class ProgramBytes:
    """A program's bytes as XLA counts them (`compiled.memory_analysis()`'s fields, or a
    trace's estimate): temporaries, arguments, outputs, outputs aliased to a donated argument."""
    temp: int
    argument: int
    output: int
    alias: int


def xla_limit(bytes_limit: int, prog: ProgramBytes, slop: int = SLOP_PERCENT) -> int:
    """The limit XLA's rematerialisation holds `prog` to, in bytes (GetSchedulerMemoryLimit with
    JAX's device_memory_size; C++ integer arithmetic, truncated)."""
    io = prog.argument + prog.output - prog.alias
    return (bytes_limit - io) * slop // 100


def remat_peak(prog: ProgramBytes) -> int:
    """What XLA's rematerialisation compares with the limit: temporaries plus every output."""
    return prog.temp + prog.output


def fits(bytes_limit: int, prog: ProgramBytes, slop: int = SLOP_PERCENT) -> bool:
    """Whether XLA compiles `prog` without rematerialising (and without the warning)."""
    return remat_peak(prog) <= xla_limit(bytes_limit, prog, slop)


def blocks_within_limit(bytes_limit: int, prog: ProgramBytes, num_blocks: int,
                        block_bytes: int, slop: int = SLOP_PERCENT) -> int:
    """The most KV blocks for which `prog` (measured with a donated pool of `num_blocks` blocks
    of `block_bytes` each, aliased to its output) still fits XLA's limit: each block more adds
    its bytes to argument, output and alias alike, so it lowers the limit by slop% of them and
    raises the peak by all of them. Negative when no pool fits (the caller clamps)."""
    room = slop * (bytes_limit - (prog.argument + prog.output - prog.alias)) \
        - 100 * remat_peak(prog)
    return num_blocks + room // ((100 + slop) * block_bytes)
