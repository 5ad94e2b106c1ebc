"""A prefill chunk that skips pads takes its prompt tokens from the layout's int64 array: the
33K-id token list of a cached span request is not converted inside its time to first token
(issue 28), and the rows hold the same tokens, positions and slots."""

from __future__ import annotations

import numpy as np

from list_guards import NoSlices
from serving.layout import build_layout
from serving.scheduler import ScheduledSeq
from serving.sequence import Sequence
from serving.step.step_inputs import SeatTables


def test_pad_skipping_chunk_reads_prompt_tokens_from_the_layout():
    bs, pad, ssep, pdep = 4, 0, 1, 2
    tokens = [5, 6, 7, pad, ssep, 8, 9, pad, pdep, 10, 11, 12, 13]
    lay = build_layout(tokens, bs, pad_id=pad, ssep_id=ssep, pdep_id=pdep)
    seq = Sequence("r", tokens, lay, None, bs, seed=0)
    seq.token_ids = NoSlices(tokens)
    seq.block_table, seq.seat = [7, 3, 9, 4], 0
    idx = np.flatnonzero(~lay.is_pad)  # every valid prompt token: pads skipped
    entry = ScheduledSeq(seq, idx, len(tokens), True, True)
    t = 16
    v = {f: np.zeros(t, np.int32) for f in ("tokens", "q_positions", "q_window_start",
                                            "q_seq", "slot_mapping")}
    v.update(cu_q_lens=np.zeros(2, np.int32), num_blocks=np.zeros(1, np.int32),
             logits_indices=np.zeros(1, np.int32))
    rows = SeatTables(1, 8, bs).prefill_rows([entry], 0, v)
    assert rows == idx.size
    assert v["tokens"][:rows].tolist() == [tokens[i] for i in idx]
    assert v["q_positions"][:rows].tolist() == lay.pos[idx].tolist()
    table = np.asarray(seq.block_table)
    assert v["slot_mapping"][:rows].tolist() == (table[idx // bs] * bs + lay.slot_off[idx]).tolist()
