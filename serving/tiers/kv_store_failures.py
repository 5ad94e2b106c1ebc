"""Span-store writes that failed: counted, and told in one warning per flush.

A store that cannot be written (a full disk, a read-only folder, a folder where a run file
belongs, a file where a store folder belongs) is a cache that misses, never an error that costs
a result: the blocks stay cached in this process (device, host tier) and other processes
compute them. Writes fail on writer threads, file by file; the engine's thread tells them at
`KVStoreTier.flush` (the end of a generate call or a batch job) in one warning that names the
first error and how many blocks were not stored.
"""

from __future__ import annotations

import threading
import warnings


class WriteFailures:
    """Failed writes since the last report. Thread-safe."""

    def __init__(self, counters: dict):
        self.counters = counters  # the tier's: write_errors (writes), blocks_not_written
        self.counters.update(write_errors=0, blocks_not_written=0)
        self.lock = threading.Lock()
        self.blocks = 0
        self.first: BaseException | None = None

    def record(self, blocks: int, err: BaseException) -> None:
        """A write of `blocks` blocks failed with `err` (any thread)."""
        with self.lock:
            self.counters["write_errors"] += 1
            self.counters["blocks_not_written"] += blocks
            self.blocks += blocks
            if self.first is None:
                self.first = err

    def report(self) -> None:
        """One warning for the failures since the last report, if any."""
        with self.lock:
            blocks, err, self.blocks, self.first = self.blocks, self.first, 0, None
        if err is not None:
            warnings.warn(f"kv store: {blocks} blocks could not be written to the span store "
                          f"({type(err).__name__}: {err}); they stay cached in this process "
                          f"only, and the results are unaffected", RuntimeWarning, stacklevel=3)
