"""The device tier of the checkpoint store: one preallocated pool of recurrent states.

  conv  [Lg, N, C, Kc-1]    in the cache's conv dtype
  delta [Lg, N, Hv, Dk, Dv] float32 (the recurrent state is float32; keeping it so is what makes a
                            restore exact)
Lg recurrent layers, N slots. One checkpoint = Lg * (C (Kc-1) itemsize + Hv Dk Dv 4) bytes, exactly
what `nbytes` reports. Inside the jitted step the runner reads restore rows (`rows`) before the
model runs and writes the step's checkpoints (`store_rows`) after; between steps whole slots move
to and from host memory with one jitted gather / scatter per step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta.api import CheckpointRows
from serving.tiers.offload import HostBatch

# How a prefill step stores its K checkpoint rows (A/B'd by benchmarks/fixed_step_work.py's
# forms): CHECKPOINTS_STACKED has the model stack each GDN layer's rows ([Lg, K, ...]: 288 MiB of
# float32 states at Qwen3.5-0.8B, K = 16, written whole however few checkpoints the step takes)
# and scatters the stack once; off, each layer's rows are scattered straight into their layer
# of the pool (the span-map pool's store made the same change, span_maps.STORE_STACKED).
CHECKPOINTS_STACKED = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CheckpointPool:
    conv: jax.Array  # [Lg, N, C, Kc-1]
    delta: jax.Array  # [Lg, N, Hv, Dk, Dv] float32

    @property
    def slots(self) -> int:
        return self.conv.shape[1]


def state_layout(family, mcfg, block_size: int, dtype):
    """(Lg, conv slot shape, conv dtype, delta slot shape) of a hybrid family's recurrent cache,
    read off a one-page, one-slot cache (contract: `conv`, `delta` tuples of [slots, ...])."""
    probe = family.init_cache(mcfg, 1, block_size, 1, dtype)
    lg = len(probe.conv)
    if lg == 0:
        return 0, (), np.dtype(dtype), ()
    return lg, probe.conv[0].shape[1:], probe.conv[0].dtype, probe.delta[0].shape[1:]


def pool_axes(cache_axes) -> CheckpointPool:
    """Logical axes of the pool (serving/step/sharding.py places it by them): each state's axes
    in the cache (the family's `cache_axes`) behind the layer axis, so a checkpoint lives on the
    devices, in the shards, of the state it is taken from and restored into."""
    return CheckpointPool(conv=(None,) + tuple(cache_axes.conv[0]),
                          delta=(None,) + tuple(cache_axes.delta[0]))


def checkpoint_nbytes(layout) -> int:
    """Exact bytes of one checkpoint (every recurrent layer's conv + delta state)."""
    lg, conv_shape, conv_dtype, delta_shape = layout
    return lg * (int(np.prod(conv_shape)) * np.dtype(conv_dtype).itemsize
                 + int(np.prod(delta_shape)) * 4)


def allocate(layout, slots: int) -> CheckpointPool:
    lg, conv_shape, conv_dtype, delta_shape = layout
    pool = CheckpointPool(conv=jnp.zeros((lg, slots) + tuple(conv_shape), conv_dtype),
                          delta=jnp.zeros((lg, slots) + tuple(delta_shape), jnp.float32))
    jax.block_until_ready(pool)
    return pool


def rows(pool: CheckpointPool, idx):
    """idx [S] slots (-1 = none) -> conv [Lg, S, ...], delta [Lg, S, ...] (row of slot 0 where
    idx < 0; callers mask those rows)."""
    safe = jnp.maximum(idx, 0)
    return pool.conv[:, safe], pool.delta[:, safe]


def store_rows(pool: CheckpointPool, idx, conv, delta) -> CheckpointPool:
    """Write conv [Lg, K, ...] / delta [Lg, K, ...] into slots idx [K] (-1 = dropped); conv
    and delta may also be sequences of Lg arrays [K, ...] (each layer scattered into its layer
    of the pool: no stacked copy)."""
    target = jnp.where(idx >= 0, idx, pool.slots)
    if isinstance(conv, (tuple, list)):
        def put(buf, rows):
            for layer, x in enumerate(rows):
                buf = buf.at[layer, target].set(x.astype(buf.dtype), mode="drop")
            return buf
        return CheckpointPool(conv=put(pool.conv, conv), delta=put(pool.delta, delta))
    return CheckpointPool(conv=pool.conv.at[:, target].set(conv.astype(pool.conv.dtype),
                                                           mode="drop"),
                          delta=pool.delta.at[:, target].set(delta.astype(jnp.float32),
                                                             mode="drop"))


def restore(family, cache, pool: CheckpointPool, state_slots, idx):
    """Write pool slots idx [R] (-1 = none) into the cache's state slots state_slots [R]: R
    states gathered and scattered per recurrent layer."""
    conv, delta = rows(pool, idx)
    return family.write_states(cache, state_slots, conv, delta, idx >= 0)


def checkpointed_forward(family, params, tokens, md, cache, mcfg, pool, f, decode_only, kw,
                         with_extras: bool = False):
    """The hybrid forward with the checkpoint pool (inside the jitted step): restore rows'
    states are written into their slots before the model runs (their reset flag is off), and the
    states at each row's checkpoint position go to the pool after. Decode-only steps neither
    restore nor checkpoint (a checkpoint position is a prefill chunk's). The step's restores are
    R flat rows (f["restore_seq"], f["restore_slot"]: [R], -1 = none,
    checkpoint_plan.restore_rows), its checkpoints K (f["ck_seq"], f["ck_pos"], f["ck_slot"]:
    [K], checkpoint_plan.step_rows), each written into its slot.
    with_extras: also return the model's third output (e.g. captured span maps,
    serving/hybrid/span_maps.py)."""
    if decode_only:
        logits, cache = family.forward(params, tokens, md, cache, mcfg, **kw)
        return (logits, cache, pool, {}) if with_extras else (logits, cache, pool)
    # R flat rows: R states gathered and written per GDN layer, not one per sequence
    targets = f["state_slots"][jnp.maximum(f["restore_seq"], 0)]
    cache = restore(family, cache, pool, targets, f["restore_slot"])
    ck_rows = CheckpointRows(f["ck_seq"], f["ck_pos"])  # K flat rows: K states written, not S M
    if not CHECKPOINTS_STACKED:
        kw = dict(kw, stack_checkpoints=False)  # per layer, into the pool's layers
    logits, cache, ck = family.forward_with_checkpoints(
        params, tokens, md, cache, mcfg, checkpoint_at=ck_rows, **kw)
    if ck is not None:  # [Lg, K, ...] (or Lg arrays [K, ...]), like the slots
        pool = store_rows(pool, f["ck_slot"], ck["conv"], ck["delta"])
    return (logits, cache, pool, ck) if with_extras else (logits, cache, pool)


def _bucket(n: int) -> int:
    return max(4, 1 << (n - 1).bit_length())


@jax.jit
def _gather(pool, ids):
    return [pool.conv[:, ids], pool.delta[:, ids]]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(pool, ids, conv, delta):
    return CheckpointPool(conv=pool.conv.at[:, ids].set(conv, mode="drop"),
                          delta=pool.delta.at[:, ids].set(delta, mode="drop"))


def gather(pool: CheckpointPool, slots: list[int]) -> HostBatch:
    ids = np.zeros(_bucket(len(slots)), np.int32)
    ids[:len(slots)] = slots
    return HostBatch(_gather(pool, jnp.asarray(ids)))


def scatter(pool: CheckpointPool, slots: list[int], sources) -> CheckpointPool:
    """sources: (HostBatch, row) per slot."""
    nb = _bucket(len(slots))
    ids = np.full(nb, pool.slots, np.int32)  # out of range rows are dropped
    ids[:len(slots)] = slots
    conv = np.zeros((pool.conv.shape[0], nb) + pool.conv.shape[2:], pool.conv.dtype)
    delta = np.zeros((pool.delta.shape[0], nb) + pool.delta.shape[2:], np.float32)
    for k, (batch, row) in enumerate(sources):
        c, d = batch.materialize()
        conv[:, k] = c[:, row]
        delta[:, k] = d[:, row]
    return _scatter(pool, jnp.asarray(ids), jnp.asarray(conv), jnp.asarray(delta))


def apply_moves(pool: CheckpointPool, moves_out, moves_in) -> CheckpointPool:
    """Carry out a step's store moves: gather the evicted slots out (their entries then live on
    the host), then scatter host entries into their new slots."""
    if moves_out:
        batch = gather(pool, [s for s, _ in moves_out])
        for row, (_, e) in enumerate(moves_out):
            e.host = (batch, row)
    if moves_in:
        pool = scatter(pool, [s for s, _ in moves_in], [e.host for _, e in moves_in])
        for _, e in moves_in:
            e.host = None
    return pool


def default_slots(config, nbytes: int) -> int:
    """Device slots for Config.hybrid_cache.budget_gb (None: 5% of the device's memory limit, or 64
    checkpoints on a backend without memory stats)."""
    if config.hybrid_cache.budget_gb is not None:
        return int(config.hybrid_cache.budget_gb * (1 << 30)) // max(nbytes, 1)
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU backends may not report memory
        stats = {}
    if "bytes_limit" in stats:
        return int(0.05 * stats["bytes_limit"]) // max(nbytes, 1)
    return 64
