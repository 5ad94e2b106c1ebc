"""Where a prompt's segments, pads and logical positions are (DESIGN §3, the three primitives).

A marker (SSEP or PDEP id) counts only at a block start; elsewhere it is plain text. Block 0
without a marker behaves as PDEP. Pad tokens are invisible: they take no logical position, are
never fed as queries, and a block stores its valid (non-pad) tokens as a prefix of its slots.
Generated tokens extend the last segment.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PromptLayout:
    is_pad: np.ndarray  # [N] bool
    pad_index: np.ndarray  # [P] int64 ascending indices of the pads (a prompt has few)
    block_win: np.ndarray  # [NBp] int32 smallest logical position its tokens may attend
    block_size: int
    block_valid: np.ndarray  # [NBp] int32 valid tokens per prompt block
    block_pos_start: np.ndarray  # [NBp] int32 logical position of each block's first slot
    span_block: np.ndarray  # [NBp] bool block lies in an SSEP span
    span_start: np.ndarray  # [NBp] bool an SSEP span starts at this block
    seg_start: np.ndarray  # [NBp] bool a segment (block 0, SSEP or PDEP) starts at this block
    num_valid: int  # non-pad prompt tokens
    last_win: int  # window start of the last segment (generated tokens inherit it)
    last_valid_index: int  # index of the last non-pad prompt token
    has_markers: bool
    tokens: np.ndarray | None = None  # [N] int64 the prompt (hashed from here: no re-conversion)
    _pos: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

    # Per-token positions, window starts and slots are read for the tokens a step computes
    # (`pos_at`, `win_at`, `slot_off_at`): a cached 33K-token prompt computes a few dozen, so
    # its [N] arrays are made only where a caller asks for the whole prompt's (`pos`, `win`,
    # `slot_off`): the positions' cumsum was ~20 us of that request's host time (issue 28).
    @property
    def num_tokens(self) -> int:
        return self.is_pad.shape[0]

    def pos_at(self, idx) -> np.ndarray:
        """[n] int32 logical position of tokens `idx` (indices or a slice): the valid tokens
        before each (a pad's is the next valid token's)."""
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(self.num_tokens))
        idx = np.asarray(idx)
        return (idx - np.searchsorted(self.pad_index, idx)).astype(np.int32)

    @property
    def pos(self) -> np.ndarray:
        """[N] int32 logical position of every token (made once, on first use)."""
        if self._pos is None:
            before = np.empty(self.num_tokens, np.int32)
            if before.size:
                before[0] = 0
                np.cumsum(~self.is_pad[:-1], dtype=np.int32, out=before[1:])
            self._pos = before
        return self._pos

    def win_at(self, idx) -> np.ndarray:
        """[n] int32 smallest logical position tokens `idx` (indices or a slice) may attend."""
        return self.block_win[self._token_blocks(idx)]

    def slot_off_at(self, idx) -> np.ndarray:
        """[n] int32 slot of tokens `idx` (indices or a slice) inside their blocks (valid
        tokens; a pad's is the next valid token's)."""
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(self.num_tokens))
        return self.pos_at(idx) - self.block_pos_start[self._token_blocks(idx)]

    def _token_blocks(self, idx) -> np.ndarray:
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(self.num_tokens))
        return np.asarray(idx) // self.block_size

    @property
    def win(self) -> np.ndarray:
        """[N] int32 smallest logical position each token may attend."""
        return np.repeat(self.block_win, self.block_size)[:self.num_tokens]

    @property
    def slot_off(self) -> np.ndarray:
        """[N] int32 slot of each token inside its block (valid tokens only)."""
        n = self.num_tokens
        return self.pos - np.repeat(self.block_pos_start, self.block_size)[:n]


def build_layout(tokens, block_size: int, *, pad_id: int | None, ssep_id: int | None,
                 pdep_id: int | None, markers: bool = True) -> PromptLayout:
    """Analyse a prompt (markers and pads already placed). `markers=False` treats all as text."""
    t = np.asarray(tokens, dtype=np.int64)
    n = t.shape[0]
    nb = -(-n // block_size)
    is_pad = (t == pad_id) if (markers and pad_id is not None) else np.zeros(n, bool)
    # a token's logical position is its index less the pads before it: blocks' valid tokens
    # and first positions come from the few pads' indices (a 33K-token prompt's layout is
    # built inside its time to first token: no pass over its tokens beyond finding the pads)
    pads = np.flatnonzero(is_pad)
    block_valid = (block_size - np.bincount(pads // block_size, minlength=nb)).astype(np.int32)
    if nb:
        block_valid[-1] -= nb * block_size - n  # a partial last block
    block_pos_start = np.zeros(nb, np.int32)
    np.add.accumulate(block_valid[:-1], out=block_pos_start[1:])  # int32 (cumsum: via int64)
    first = t[::block_size]  # each block's first token (strided views: no index array)
    if markers:
        is_ssep = first == ssep_id if ssep_id is not None else np.zeros(nb, bool)
        is_pdep = first == pdep_id if pdep_id is not None else np.zeros(nb, bool)
    else:
        is_ssep = is_pdep = np.zeros(nb, bool)
    seg_start = is_ssep | is_pdep
    seg_start[0] = True
    seg_first_block = np.flatnonzero(seg_start)
    # per segment, then repeated over its blocks: a prompt has a few segments, and repeating
    # costs less than a cumsum of segment ids and two gathers over its ~2,000 blocks
    seg_blocks = np.empty_like(seg_first_block)  # blocks per segment (np.diff's append: ~6 us)
    np.subtract(seg_first_block[1:], seg_first_block[:-1], out=seg_blocks[:-1])
    seg_blocks[-1] = nb - seg_first_block[-1]
    seg_span = is_ssep[seg_first_block]
    span_block = np.repeat(seg_span, seg_blocks)
    seg_win = np.where(seg_span, block_pos_start[seg_first_block], 0).astype(np.int32,
                                                                              copy=False)
    num_valid = n - pads.size
    return PromptLayout(
        is_pad=is_pad, pad_index=pads, block_win=np.repeat(seg_win, seg_blocks),
        block_size=block_size,
        block_valid=block_valid, block_pos_start=block_pos_start,
        span_block=span_block, span_start=is_ssep & seg_start, seg_start=seg_start,
        num_valid=num_valid, last_win=int(seg_win[-1]) if nb else 0,
        last_valid_index=_last_valid(is_pad, block_valid, block_size),
        has_markers=bool(is_ssep.any() or is_pdep.any()), tokens=t)


def _last_valid(is_pad: np.ndarray, block_valid: np.ndarray, block_size: int) -> int:
    """Index of the last non-pad token (-1: none), found in the last block holding one (a
    whole-prompt search from the end costs as much as the layout's other passes)."""
    if block_valid.size and block_valid[-1]:  # the usual case: no pass over the blocks
        start = (block_valid.size - 1) * block_size
    else:
        full = np.flatnonzero(block_valid)
        if not full.size:
            return -1
        start = int(full[-1]) * block_size
    return start + int(np.flatnonzero(~is_pad[start:start + block_size])[-1])
