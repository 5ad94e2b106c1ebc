"""How much of a capturing span step's flow a flow that skipped its captured spans would save
(host only, any backend; issue 29's zipf gap, an idea not built).

    python -m benchmarks.rag_flow_rows CONFIG [rag options...]

A capturing span step runs the flow over every row, the captured spans' too, though the state
after a span it captures whole is A S + B of the map it captures. If a chunk ends with such spans
(no other rows after them), its flow could stop before them and the sequence's next chunk enter
through the compose program, as after skipped spans. Runs configuration CONFIG in this process
(as `benchmarks/rag_steps.py` does) and prints per workload run: the capturing steps, their
rows, and the rows of spans captured whole at the tail of their chunk (what the flow would not
run), and the steps that would need a compose program for it though they have none (the
price: ~1 ms each on an H100, a launch-bound program of 53 kernels).
"""

from __future__ import annotations

import sys

import numpy as np


def tail_rows(e) -> int:
    """Rows at the end of scheduled entry `e` that are spans it captures whole."""
    from serving.hybrid import span_rows
    idx = np.asarray(e.token_idx)
    if not idx.size or not e.map_caps:
        return 0
    ends = {a: b for a, b, _ in span_rows.spans_of(e.seq, e.seq.block_size)}
    covered = np.zeros(idx.size, bool)
    for a, _, cont in e.map_caps:
        if not cont and a >= idx[0] and ends.get(a, 1 << 62) <= e.new_computed:
            covered |= (idx >= a) & (idx < ends[a])
    k = idx.size
    while k and covered[k - 1]:
        k -= 1
    return idx.size - k


def main(argv) -> int:
    from benchmarks.rag_steps import run_logged
    steps, lagging = [], set()

    def on_batch(batch):
        enters = [e.seq.seq_id in lagging for e in batch if len(e.token_idx)]
        lagging.difference_update(e.seq.seq_id for e in batch if len(e.token_idx))
        tails = [tail_rows(e) for e in batch]
        lagging.update(e.seq.seq_id for e, t in zip(batch, tails) if t)
        new_compose = any(enters) and not any(e.map_chain for e in batch)
        steps.append((sum(len(e.token_idx) for e in batch), sum(tails),
                      any(e.map_caps for e in batch), new_compose))

    def begin():
        steps.clear()
        lagging.clear()

    def end(salt):
        a = np.array(steps, dtype=np.int64).reshape(-1, 4)
        cap = a[a[:, 2] == 1]
        rows, tail = int(cap[:, 0].sum()), int(cap[:, 1].sum())
        print(f"{salt}: {len(a)} steps, {len(cap)} capturing; their rows {rows}, "
              f"rows of spans captured whole at a chunk's tail {tail} ({tail / max(rows, 1):.1%}); "
              f"steps that would need a compose program they lack: {int(a[:, 3].sum())}",
              flush=True)
    return run_logged(argv, "python -m benchmarks.rag_flow_rows", on_batch, begin, end)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
