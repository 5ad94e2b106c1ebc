"""benchmarks/rag_flow_rows.py's count: the rows at a chunk's tail that are spans it captures whole
(what a flow that skipped captured spans would not run)."""

from types import SimpleNamespace

import numpy as np

from benchmarks.rag_flow_rows import tail_rows


def _entry(rows, caps, new_computed):
    spans = [(0, 40, False), (40, 70, False), (70, 100, False), (100, 130, True)]
    seq = SimpleNamespace(memo=SimpleNamespace(span_intervals=spans), block_size=16)
    return SimpleNamespace(token_idx=np.asarray(rows), map_caps=caps, seq=seq,
                           new_computed=new_computed)


def test_tail_rows_counts_trailing_whole_captures_only():
    caps = ((40, 1, 0), (70, 2, 0))
    assert tail_rows(_entry(range(30, 100), caps, 100)) == 60  # both spans end the chunk
    assert tail_rows(_entry(range(30, 110), caps, 110)) == 0  # rows after them: the flow runs
    assert tail_rows(_entry(range(30, 100), ((40, 1, 0),), 100)) == 0  # the last one not captured
    assert tail_rows(_entry(range(30, 90), caps, 90)) == 0  # its tail is a piece of the second
    assert tail_rows(_entry(range(75, 100), ((70, 2, 1),), 100)) == 0  # a continued piece
    assert tail_rows(_entry([], caps, 30)) == 0
