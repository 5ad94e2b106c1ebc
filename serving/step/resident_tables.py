"""Block tables kept on the device (issue 28): the seats' block-table rows live in one device array
[3, seats + 1, NB] int32 (block ids, the logical position each block starts at, valid tokens in
it; row `seats` is the scratch seat padding rows read, never written, all zero). A step no
longer carries [S, NB] rows of each (1.6 MB at 64 seats and a 33K-token max_model_len): it
carries only what changed since the last step, as runs of consecutive entries of the flattened
array (start, length) and their values, and applies them with one scatter before gathering its
seats' rows. A cached request's admission sends ~25 KB (its ~2,000 blocks' three entries), a
decode ~12 bytes per sequence.

The host `SeatTables` (serving/step/step_inputs.py) stays the source of truth: every write to
its rows is logged as a run, and the device array equals it after each step (tests/
test_resident_tables.py). A step whose changes do not fit its static capacity (several long
cached prompts admitted at once) sends none and the whole host array is uploaded instead,
as the runner does the first time: exact either way, only the transfer's size differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FIELDS = ("table_seat", "tbl_start", "tbl_len", "tbl_val")
RUNS_PER_SEQ = 5  # a sequence's runs per step: 3 synced slices, its last block's fill, a decode
# up to this many runs are copied slice by slice (a cached admission's three ~2,000-entry runs:
# ~4 us, where building the index of one gather over them cost ~23 us); more (decodes: a few
# entries a sequence), by that one gather
FEW_RUNS = 16


def capacity(t: int, s: int, nb: int, block_size: int) -> tuple[int, int]:
    """(runs, values) a step of bucket (t, s) carries: room for every sequence's runs, the blocks
    its computed tokens can open (3 entries each, 2 partial blocks per sequence) plus one whole
    row of each field (one cached prompt of max_model_len admitted)."""
    return RUNS_PER_SEQ * s + 8, 3 * (nb + t // block_size + 2 * s) + 2 * s


def layout_fields(t: int, s: int, nb: int, block_size: int) -> tuple:
    """(name, shape) of the resident-table fields of a step's packed int buffer: the seat each
    row gathers (padding rows: the scratch seat), the runs and their values."""
    runs, values = capacity(t, s, nb, block_size)
    return (("table_seat", (s,)), ("tbl_start", (runs,)), ("tbl_len", (runs,)),
            ("tbl_val", (values,)))


def pack(stack: np.ndarray, runs: list, v: dict) -> bool:
    """Write the logged runs [(flat start, length), ...] of `stack` (the host tables) into the
    step's fields; False (nothing written) when they do not fit: the caller uploads instead."""
    starts, lens = v["tbl_start"], v["tbl_len"]
    if len(runs) > starts.size:
        return False
    lo = np.fromiter((r[0] for r in runs), np.int64, len(runs))
    n = np.fromiter((r[1] for r in runs), np.int64, len(runs))
    total = int(n.sum())
    if total > v["tbl_val"].size:
        return False
    flat = stack.reshape(-1)
    if len(runs) <= FEW_RUNS:
        at = 0
        for start, k in runs:
            v["tbl_val"][at:at + k] = flat[start:start + k]
            at += k
    elif total:
        # every run's entries, gathered in one go: run r covers lo[r] .. lo[r] + n[r]
        ends = np.cumsum(n)
        idx = np.arange(total) - np.repeat(ends - n, n) + np.repeat(lo, n)
        v["tbl_val"][:total] = flat[idx]
    starts[:len(runs)] = lo
    lens[:len(runs)] = n
    return True


def upload(stack: np.ndarray, mesh=None):
    """The host tables as the device array a step takes (replicated over a TP mesh)."""
    if mesh is None:
        return jnp.asarray(stack)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.device_put(stack, sharding)


def pin(tables, mesh):
    """Inside a traced TP step: the tables come out replicated, as they went in."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.lax.with_sharding_constraint(tables, sharding)


def apply(tables, f: dict):
    """On device: the step's runs written into `tables` ([3, seats + 1, NB]); returns the new
    tables and the step's rows (block_tables, block_pos_start, block_num_valid), [S, NB] each."""
    shape = tables.shape
    flat = tables.reshape(-1)
    starts, lens, vals = f["tbl_start"], f["tbl_len"], f["tbl_val"]
    ends = jnp.cumsum(lens)
    j = jnp.arange(vals.shape[0], dtype=ends.dtype)
    # compare_all: one broadcast compare and sum ([values, runs], ~2M compares at 64 seats and a
    # 33K max_model_len). The default binary search is a while loop (a host round trip per level
    # on a GPU); "scan_unrolled" puts one op per run into every step program (+18% compile time
    # of the CPU suite's steps)
    run = jnp.searchsorted(ends, j, side="right", method="compare_all")
    run = jnp.minimum(run, lens.shape[0] - 1)
    idx = starts[run] + j - (ends[run] - lens[run])
    idx = jnp.where(j < ends[-1], idx, flat.shape[0])  # past the last run: dropped
    tables = flat.at[idx].set(vals, mode="drop").reshape(shape)
    rows = tables[:, f["table_seat"]]
    return tables, (rows[0], rows[1], rows[2])


class DeviceTables:
    """The runner's side of it: the device array a step takes (`arg`), the step's table fields
    (`fill`), the array the step returns kept (`keep`). `on` False: the earlier path, each step
    carrying its seats' [S, NB] rows (SeatTables.copy_rows), kept for A/B."""

    def __init__(self, host, mesh, scratch_seat: int, on: bool = True):
        self.host, self.mesh, self.scratch_seat = host, mesh, scratch_seat
        self.on, self.array = on, None
        # a step's changes were packed but its tables never came back (the step raised, or
        # was never dispatched): the next step uploads the whole host array instead
        self.pending = False

    def set(self, on: bool) -> None:
        """Switch paths; switching on uploads the host tables at the next step."""
        self.on, self.array = on, None
        self.host.take_runs()

    def arg(self):
        """The device tables a step takes (None when off); uploaded whole from the host's when
        there are none (the first step, or a step whose changes did not fit: see fill)."""
        if not self.on:
            return None
        if self.array is None:
            self.array = upload(self.host.stack, self.mesh)
        return self.array

    def keep(self, tables) -> None:
        """The tables a step returned: the device copy from now on."""
        self.array, self.pending = tables, False

    def fill(self, seats, v) -> None:
        """The batch's block tables into the step's fields: the changes since the last step, or
        (off) the seats' rows."""
        runs = self.host.take_runs()
        if not self.on:
            self.host.copy_rows(seats, v)
            return
        v["table_seat"][:] = self.scratch_seat
        v["table_seat"][:len(seats)] = seats
        if self.pending or not pack(self.host.stack, runs, v):
            self.array = None  # arg() uploads the host tables, these changes included
        self.pending = True
