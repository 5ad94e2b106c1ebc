"""XLA's memory limit for a compiled GPU program, and how many KV blocks a default pool may take
so that every step program stays under it (issue 28: XLA's "Can't reduce memory use below
... by rematerialization" warning at warm-up).

How XLA (jaxlib 0.11.2) gets the limit it warns about (source, then the device's VLOG):
  * jaxlib/py_client.cc, `PyClient::CompileAndLoadIfrtProgram`: every compile JAX asks for gets
    `ExecutableBuildOptions.device_memory_size` = the device allocator's `bytes_limit` (what
    `memory_stats()["bytes_limit"]` reports, 75% of the card by default: fixed when the client
    starts, not the memory free at compile time). XLA's own internal compiles (autotuning)
    get none and use 80% of the card.
  * xla/service/gpu/gpu_hlo_schedule.cc, `GetSchedulerMemoryLimit`: slop% (the
    xla_gpu_memory_limit_slop_factor flag, default 95) of (device_memory_size - io), io =
    every entry parameter + every output - the outputs aliased to a parameter.
  * xla/service/gpu/gpu_compiler.cc, `RunPostSchedulingPipelines`, runs `HloRematerialization`
    (xla/hlo/transforms/simplifiers/hlo_rematerialization.cc, `RunImpl`); the limit it logs and
    warns with is that figure plus the aliased outputs' bytes (measured: H100, tulu3 step with
    a 21.13 GiB donated pool, 36.09 GiB of arguments: "memory limit of 43.26GiB", "adjusted for
    output (21.13GiB): 22.13GiB" = 95% of (59.38 - 36.09)). It compares the limit with the entry
    computation's peak plus every output, and the entry peak holds the parameters that are
    not donated (the weights: "Peak memory for main: 26.73GiB" = 14.96 of weights + 11.77 of
    temporaries, 47.85 with the outputs).
So the weights count twice (in io, and again in the peak): a program fits when
  temp + (argument - alias) + output <= slop% of (bytes_limit - argument - output + alias) + alias
and each donated pool block costs slop% of its bytes against that margin. The two warnings on
record fit it: the ttft engine at max_model_len 33,792 (share-rule pool of ~23.6 GiB on the H100,
~60.3 GiB on the H200) gives 43.4 and 88.8 GiB, the limits warned (43.35, 88.83).

Two ways out: a pool small enough for XLA's rule (`blocks_within_limit`, kv_pool.CAP_BY_XLA_LIMIT,
off: ~18% of the pool at 40,960 on the H100), or XLA told the truth (`exact_slop`,
Config.compilation.xla_memory_limit "exact"): a slop factor per engine under which the check reads
"temporaries within 95% of the room the program's buffers leave", the weights counted once
(159 for the H100 step above, whose 11.77 GiB of temporaries had 23.29 GiB free).
"""

from __future__ import annotations

from dataclasses import dataclass

SLOP_PERCENT = 95  # XLA's default xla_gpu_memory_limit_slop_factor (the engine passes none)
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class ProgramBytes:
    """A program's bytes as XLA counts them (`compiled.memory_analysis()`'s fields, or a
    trace's estimate): temporaries, arguments, outputs, outputs aliased to a donated argument."""
    temp: int
    argument: int
    output: int
    alias: int


def xla_limit(bytes_limit: int, prog: ProgramBytes, slop: int = SLOP_PERCENT) -> int:
    """The limit XLA's rematerialisation holds `prog` to and prints in its warning, in bytes
    (GetSchedulerMemoryLimit with JAX's device_memory_size, C++ integer arithmetic, plus the
    aliased outputs, as measured)."""
    io = prog.argument + prog.output - prog.alias
    return (bytes_limit - io) * slop // 100 + prog.alias


def remat_peak(prog: ProgramBytes) -> int:
    """What XLA's rematerialisation compares with the limit: temporaries, the arguments not
    aliased to an output (the weights), and every output."""
    return prog.temp + prog.argument - prog.alias + prog.output


def fits(bytes_limit: int, prog: ProgramBytes, slop: int = SLOP_PERCENT) -> bool:
    """Whether XLA compiles `prog` without rematerialising (and without the warning)."""
    return remat_peak(prog) <= xla_limit(bytes_limit, prog, slop)


def blocks_within_limit(bytes_limit: int, prog: ProgramBytes, num_blocks: int,
                        block_bytes: int, slop: int = SLOP_PERCENT) -> int:
    """The most KV blocks for which `prog` (measured with a donated pool of `num_blocks` blocks
    of `block_bytes` each, aliased to its output) still fits XLA's limit: each block more adds
    its bytes to argument, output and alias alike, so it raises the peak by all of them and the
    limit by (100 - slop)% of them. Negative when no pool fits (the caller clamps)."""
    room = slop * (bytes_limit - (prog.argument + prog.output - prog.alias)) \
        - 100 * (remat_peak(prog) - prog.alias)
    return num_blocks + room // (slop * block_bytes)


def with_pool_bytes(prog: ProgramBytes, extra: int) -> ProgramBytes:
    """`prog` with `extra` more bytes of donated pool (traced with one pool size, run with
    another): each pool byte is an argument, an output and an alias."""
    return ProgramBytes(prog.temp, prog.argument + extra, prog.output + extra, prog.alias + extra)


def exact_slop(bytes_limit: int, prog: ProgramBytes, margin: int = SLOP_PERCENT) -> int | None:
    """The xla_gpu_memory_limit_slop_factor under which XLA's check for `prog` reads "the
    temporaries fit in `margin`% of the memory the program's buffers leave" (bytes_limit - io),
    instead of counting the buffers that are not aliased (the weights, the new outputs) a second
    time: fits(bytes_limit, prog, s) implies temp <= margin% of that room, and holds whenever
    temp <= (margin - 1)% of it. None when the buffers alone fill the limit."""
    io = prog.argument + prog.output - prog.alias
    room = bytes_limit - io
    if room <= 0:
        return None
    return min(margin + 100 * (io - prog.alias) // room, INT32_MAX)  # XLA's flag is an int32


def exact_limit_options(bytes_limit: int, programs, extra_pool_bytes: int = 0) -> dict:
    """Compiler options that give every step program in `programs` (traced with a pool
    `extra_pool_bytes` smaller than the one allocated) XLA's check of `exact_slop`: one factor,
    the smallest, so no program gets more than its margin. {} when there is nothing to set."""
    slops = [exact_slop(bytes_limit, with_pool_bytes(p, extra_pool_bytes)) for p in programs]
    slops = [s for s in slops if s is not None]
    return {"xla_gpu_memory_limit_slop_factor": min(slops)} if slops else {}
