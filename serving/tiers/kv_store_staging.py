"""The span store's staged blocks, accounted in bytes of the arrays they keep alive.

A staged block is one row of a verified run (`serving/tiers/run_file.Run`) that waits for its
copy-in. The reader threads send each run to the device as they read it (so the copy-in is one
scatter), so a staged block pins its whole run's array on the device: rows padded to
`run_rows(n)` and blocks no request wants included, until the run's last staged block is copied
in or dropped; a run whose last block went to a copy-in stays counted until the next step
begins (`end_copies`: its scatter has been dispatched; the array is freed when that has run).
The staging limit (`Config.kv_store.staging_gb`) therefore counts these arrays' bytes, not
blocks: a limit counted in blocks let the H200's warm job stage all its runs, the padded arrays
a third larger than their blocks, next to the KV pool (benchmarks/RESULTS.md, History:
superseded rows, Span store: why the session-8 warm phases failed).
"""

from __future__ import annotations

import collections

from serving.tiers.kv_store_moves import _Staged


def run_nbytes(run) -> int:
    """Bytes a run holds while staged: its device array once sent, else its host array."""
    data = run.dev if run.dev is not None else run.kv
    return 0 if data is None else int(data.nbytes)


class StagedBlocks:
    """Block key -> staged row, oldest first, with the bytes of the distinct runs behind them
    and of the runs being copied in this step (`nbytes`). Mapping-like: `in`, `len`, `pop`,
    `clear`."""

    def __init__(self):
        self.blocks: collections.OrderedDict[int, _Staged] = collections.OrderedDict()
        self.runs: dict[int, list] = {}  # id(run) -> [run, its staged keys (set), bytes]
        self.copying: list = []  # runs whose last staged block a copy-in took this step
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h) -> bool:
        return h in self.blocks

    def put(self, h: int, run, row: int) -> None:
        """Stage row `row` of `run` as block `h` (replacing an earlier staging of `h`)."""
        if h in self.blocks:
            self.pop(h)
        entry = self.runs.get(id(run))
        if entry is None:
            entry = self.runs[id(run)] = [run, set(), run_nbytes(run)]
            self.nbytes += entry[2]
        entry[1].add(h)
        self.blocks[h] = _Staged(run, row)

    def pop(self, h: int, copy_in: bool = False) -> _Staged:
        """Unstage block `h` (KeyError when absent); its run's bytes leave the count with the
        run's last staged block, at the next `end_copies` when a copy-in takes it."""
        s = self.blocks.pop(h)
        entry = self.runs[id(s.run)]
        entry[1].discard(h)
        if not entry[1]:
            del self.runs[id(s.run)]
            if copy_in:
                self.copying.append(entry)
            else:
                self.nbytes -= entry[2]
        return s

    def end_copies(self) -> None:
        """The copy-ins of the last step were dispatched: their runs leave the count."""
        self.nbytes -= sum(entry[2] for entry in self.copying)
        self.copying = []

    def drop_oldest_run(self) -> int:
        """Unstage every block of the run of the oldest staged block; returns the bytes freed."""
        s = next(iter(self.blocks.values()))
        entry = self.runs[id(s.run)]
        for h in list(entry[1]):
            self.pop(h)
        return entry[2]

    def clear(self) -> None:
        self.blocks.clear()
        self.runs.clear()
        self.copying = []
        self.nbytes = 0
