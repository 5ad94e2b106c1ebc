"""Host side of a step's inputs: the packed int32 buffer's layout (one dispatch, see
serving/step/model_runner.py), the block-table rows kept per seat and updated incrementally, and the
rows each scheduled sequence fills. Plain numpy over the scheduler's entries."""

from __future__ import annotations

import functools

import numpy as np

from serving.cache.block_manager import BULK
from serving.cache.page_zeroing import zero_rows
from serving.hybrid.checkpoint_plan import restore_rows, step_rows
from serving.hybrid.span_step import MAX_CAPTURES, piece_bound
from serving.step import resident_tables

_T_FIELDS = ("tokens", "q_positions", "q_window_start", "q_seq", "slot_mapping")
_S_FIELDS = ("num_blocks", "logits_indices", "state_slots", "reset", "top_k", "seed", "step",
             "sample_seat")
_SB_FIELDS = ("block_tables", "block_pos_start", "block_num_valid")
# hybrid prefix caching (a checkpoint pool is attached): the checkpoints this step takes as K =
# checkpoint_plan.step_rows(S) flat rows (their sequence's row in the batch, logical position and
# pool slot, -1 = none), and its restores as R = checkpoint_plan.restore_rows(S) flat rows (the
# sequence's row in the batch, the pool slot its state is restored from; -1 = none)
S_FIELDS_CKPT = ("ck_seq", "ck_pos", "ck_slot", "restore_seq", "restore_slot")


@functools.lru_cache(maxsize=None)
def layout(t: int, s: int, nb: int, ckpt: bool = False, spans: bool = False,
           maps: bool = False, *, block_size: int, resident: bool = False):
    """Static offsets of each field in the packed int32 buffer. maps: the step carries the
    span-map capture fields (serving/hybrid/span_step.py; the chains of cached maps go to their
    own program, serving/hybrid/span_compose.py). resident: the block tables live on the device
    and the step carries their changes (serving/step/resident_tables.py), not [S, NB] rows. Last,
    `zero_pages`: the fresh pages the step zeroes first (serving/cache/page_zeroing.py)."""
    spec, off = {}, 0
    if spans:  # hybrid steps holding SSEP span rows
        g = piece_bound(t, s)
        fields = (("row_span", (t,)), ("piece_cu", (g + 1,)), ("carry_local", (s,)))
        if maps:
            fields += (("cap_piece", (MAX_CAPTURES,)), ("cap_slot", (MAX_CAPTURES,)),
                       ("cap_cont", (MAX_CAPTURES,)))
        for f, shape in fields:
            spec[f] = (off, shape)
            off += int(np.prod(shape))
    for f in _T_FIELDS:
        spec[f] = (off, (t,))
        off += t
    spec["cu_q_lens"] = (off, (s + 1,))
    off += s + 1
    for f in _S_FIELDS + (S_FIELDS_CKPT if ckpt else ()):  # the row bounds read when built
        shape = ((step_rows(s),) if f.startswith("ck_") else
                 (restore_rows(s),) if f.startswith("restore_") else (s,))
        spec[f] = (off, shape)
        off += int(np.prod(shape))
    table_fields = resident_tables.layout_fields(t, s, nb, block_size) if resident else \
        tuple((f, (s, nb)) for f in _SB_FIELDS)
    for f, shape in table_fields:
        spec[f] = (off, shape)
        off += int(np.prod(shape))
    z = zero_rows(t, s, block_size)
    spec["zero_pages"] = (off, (z,))
    return spec, off + z




def fill_checkpoints(batch, v) -> None:
    """The step's restores and checkpoints as flat rows: (sequence's row in the batch, pool slot)
    per restore and (sequence's row, position, slot) per checkpoint, the scheduler's at most R
    and K (hybrid_prefix.py keeps the step's counts); unused rows -1."""
    for name in S_FIELDS_CKPT:
        v[name][:] = -1
    k, r = 0, 0
    for i, e in enumerate(batch):
        taken = (((e.ck_pos, e.ck_slot),) if e.ck_slot >= 0 else ()) + tuple(e.ck_more)
        _check_rows(e, i, "checkpoints", len(taken), k, v["ck_slot"].shape[0], "step_rows")
        for pos, slot in taken:
            v["ck_seq"][k], v["ck_pos"][k], v["ck_slot"][k] = i, pos, slot
            k += 1
        if e.restore_slot >= 0:
            _check_rows(e, i, "restores", 1, r, v["restore_slot"].shape[0], "restore_rows")
            v["restore_seq"][r], v["restore_slot"][r] = i, e.restore_slot
            r += 1


def _check_rows(e, i: int, what: str, n: int, used: int, rows: int, bound: str) -> None:
    if used + n > rows:
        raise ValueError(f"step {what}: sequence {e.seq.seq_id} (batch row {i}) takes {n} "
                         f"after {used}; the step has {rows} rows (checkpoint_plan.{bound})")


class SeatTables:
    """Block-table rows per seat ([seats, NB] each: block ids, the logical position each block
    starts at, valid tokens in it), copied into every step's inputs."""

    def __init__(self, seats: int, nb: int, block_size: int, vocab_size: int = 0,
                 marker_rows: dict[int, int] | None = None):
        self.block_size = block_size
        # markers beyond the vocabulary ({id: embedding row}, serving/config.py
        # marker_embedding_ids) are fed to the model as the rows they borrow: marker_ids sorted,
        # marker_rows aligned
        pairs = sorted((marker_rows or {}).items())
        self.vocab_size = vocab_size
        self.marker_ids = np.array([k for k, _ in pairs], np.int64)
        self.marker_rows = np.array([r for _, r in pairs], np.int32)
        # one array, the device copy's layout (serving/step/resident_tables.py): row `seats`
        # is the scratch seat padding rows read, never written
        self.stack = np.zeros((3, seats + 1, nb), np.int32)
        self.tables, self.pos_start, self.valid = self.stack
        self.nb, self.rows = nb, seats + 1
        self.runs: list = []  # (flat start, length) of every write since take_runs

    def _log(self, field: int, seat: int, lo: int, hi: int) -> None:
        self.runs.append(((field * self.rows + seat) * self.nb + lo, hi - lo))

    def take_runs(self) -> list:
        """The writes logged since the last call (the device copy's update), cleared."""
        runs, self.runs = self.runs, []
        return runs

    def sync(self, seq) -> None:
        """Copy the sequence's new block-table entries (and its last block's fill) into its
        seat's rows."""
        seat, k = seq.seat, seq.synced_blocks
        n = min(len(seq.block_table), seq.num_counted_blocks)
        if k < n:
            # many entries (an admitted cached prompt's): from the sequence's array, converted
            # once for the chunk plan, these rows and the release (Sequence.table_array)
            self.tables[seat, k:n] = seq.table_array()[k:n] if n - k >= BULK else \
                seq.block_table[k:n]
            # the prompt's blocks from the layout's arrays (a cached 33K-token prompt's 2,000
            # rows copied, not converted from lists); only its last block gains tokens after
            lay, m = seq.layout, min(n, len(seq.layout.block_valid) - 1)
            if k < m:
                self.pos_start[seat, k:m] = lay.block_pos_start[k:m]
                self.valid[seat, k:m] = lay.block_valid[k:m]
            m = max(k, m)
            if m < n:  # blocks from the prompt's last one on: the sequence's tail lists
                t0 = seq.tail_block
                self.pos_start[seat, m:n] = seq.tail_pos_start[m - t0:n - t0]
                self.valid[seat, m:n] = seq.tail_valid[m - t0:n - t0]
            seq.synced_blocks = n
            for field in range(3):
                self._log(field, seat, k, n)
        if n:
            self.valid[seat, n - 1] = seq.block_valid_at(n - 1)
            self._log(2, seat, n - 1, n)

    def decode_rows(self, entries, seats, v) -> None:
        """Rows 0..d-1 = one generated token per sequence, row i = sequence i."""
        bs = self.block_size
        seqs = [e.seq for e in entries]
        for q in seqs:
            if len(q.block_table) > q.synced_blocks:
                self.sync(q)
        d = len(seqs)
        seats = np.asarray(seats)
        # one pass over the sequences: [last token index, position, window start, token]
        cols = np.array([(len(q.token_ids) - 1, q.num_valid - 1, q.layout.last_win, q.token_ids[-1])
                         for q in seqs], np.int64).reshape(d, 4)
        last = cols[:, 0]
        pos = cols[:, 1].astype(np.int32)
        blk = last // bs
        bps = self.pos_start[seats, blk]
        self.valid[seats, blk] = pos - bps + 1
        flat = (2 * self.rows + seats) * self.nb + blk
        self.runs.extend(zip(flat.tolist(), [1] * d))
        tok = cols[:, 3]
        v["tokens"][:d] = np.where(tok < 0, -1 - seats, tok)  # pending: -(seat + 1), see launch
        v["q_positions"][:d] = pos
        v["q_window_start"][:d] = cols[:, 2]
        v["slot_mapping"][:d] = self.tables[seats, blk] * bs + pos - bps
        ar = np.arange(d, dtype=np.int32)
        v["q_seq"][:d] = ar
        v["cu_q_lens"][1:d + 1] = ar + 1
        v["num_blocks"][:d] = blk + 1
        v["logits_indices"][:d] = ar

    def prefill_rows(self, batch, d: int, v) -> int:
        """Rows of entries d.. (prefill chunks, or a sampled token after a restore): their
        tokens, positions, windows, slots and per-sequence fields; returns the rows used."""
        bs = self.block_size
        row = d
        for i in range(d, len(batch)):
            e = batch[i]
            seq, idx = e.seq, e.token_idx
            n = idx.size
            self.sync(seq)
            last = int(idx[-1]) if n else e.new_computed - 1
            if n:
                lo = int(idx[0])
                if last - lo + 1 == n and last < seq.num_prompt_tokens:
                    # contiguous prompt tokens (no pads skipped): slices instead of gathers
                    lay = seq.layout
                    v["tokens"][row:row + n] = seq.token_ids[lo:last + 1]
                    v["q_positions"][row:row + n] = lay.pos_at(slice(lo, last + 1))
                    v["q_window_start"][row:row + n] = lay.win_at(slice(lo, last + 1))
                    off = lay.slot_off_at(slice(lo, last + 1))
                else:
                    toks = seq.layout.tokens  # the prompt's int64 ids: no list conversion
                    if toks is None or last >= seq.num_prompt_tokens:
                        toks = np.asarray(seq.token_ids[lo:last + 1], np.int32)
                    else:
                        toks = toks[lo:last + 1]
                    v["tokens"][row:row + n] = toks[idx - lo]
                    pos, win, off, _ = seq.geometry(idx)
                    v["q_positions"][row:row + n] = pos
                    v["q_window_start"][row:row + n] = win
                tbl = np.asarray(seq.block_table[lo // bs:last // bs + 1], np.int32)
                v["slot_mapping"][row:row + n] = tbl[idx // bs - lo // bs] * bs + off
                if seq.num_pending and last == len(seq.token_ids) - 1:
                    v["tokens"][row + n - 1] = -1 - seq.seat  # read on device from prev
            v["q_seq"][row:row + n] = i
            row += n
            v["cu_q_lens"][i + 1] = row
            v["num_blocks"][i] = last // bs + 1 if last >= 0 else 0
            v["logits_indices"][i] = max(row - 1, 0)
        if self.marker_ids.size:  # only prompt rows can hold markers (decodes are sampled ids)
            toks = v["tokens"][d:row]
            oov = toks >= self.vocab_size
            if oov.any():
                toks[oov] = self.marker_rows[np.searchsorted(self.marker_ids, toks[oov])]
        return row

    def copy_rows(self, seats, v) -> None:
        """The batch's seats' block-table rows into the step's [S, NB] fields (the only writer
        of those fields: see clear_ints)."""
        n = len(seats)
        np.take(self.tables, seats, axis=0, out=v["block_tables"][:n])
        np.take(self.pos_start, seats, axis=0, out=v["block_pos_start"][:n])
        np.take(self.valid, seats, axis=0, out=v["block_num_valid"][:n])


def clear_ints(ints: np.ndarray, v: dict, table_rows: int) -> None:
    """Zero a reused step int buffer (ModelRunner._buffers) for a new step. Its [S, NB] block-
    table fields are most of it (1.6 MB at 64 seats and a 33K-token max_model_len: NB 2,112)
    and only SeatTables.copy_rows writes them, rows [0, n): of those only the `table_rows`
    rows the buffer's last step wrote are zeroed, the rest of the buffer whole. A resident-
    table buffer (no such fields: a few KB) is zeroed whole."""
    if _SB_FIELDS[0] not in v:
        ints[:] = 0
        return
    start = _offset(ints, v[_SB_FIELDS[0]])
    end = _offset(ints, v[_SB_FIELDS[-1]]) + v[_SB_FIELDS[-1]].size
    ints[:start] = 0
    ints[end:] = 0
    for f in _SB_FIELDS:
        v[f][:table_rows] = 0


def _offset(ints: np.ndarray, view: np.ndarray) -> int:
    return (view.__array_interface__["data"][0] - ints.__array_interface__["data"][0]) // 4


def fill_sampling(batch, seats, v, floats, s: int):
    """Sampling inputs of the sampling rows (seat, and for non-greedy rows top-k, seed, step,
    temperature, top-p); returns (all_greedy, use_filter), static arguments of the step."""
    sampled = [i for i, e in enumerate(batch) if e.sample]
    sps = [batch[i].seq.sampling_params for i in sampled]
    all_greedy = all(sp.temperature == 0 for sp in sps)
    use_filter = (not all_greedy) and any(
        sp.temperature > 0 and ((sp.top_k or 0) > 0 or sp.top_p < 1) for sp in sps)
    v["sample_seat"][sampled] = [seats[i] for i in sampled]
    if sampled and not all_greedy:  # greedy rows read none of these (argmax of the logits)
        seqs = [batch[i].seq for i in sampled]
        v["top_k"][sampled] = [max(sp.top_k or 0, 0) for sp in sps]
        v["seed"][sampled] = [q.seed & 0x7FFFFFFF for q in seqs]
        v["step"][sampled] = [len(q.token_ids) - q.num_prompt_tokens for q in seqs]
        floats[sampled] = [sp.temperature for sp in sps]
        floats[np.asarray(sampled) + s] = [sp.top_p for sp in sps]
    return all_greedy, use_filter
