"""How the scheduler cuts a `minipic-bench rag` configuration into steps (host only, any backend).

    python -m benchmarks.rag_steps CONFIG [rag options...]

Runs configuration CONFIG in this process (as the bench's worker does) with `Scheduler.schedule`
wrapped, and prints per workload run: steps, rows per step (mean and a histogram), sequences per
step, and how many steps each request's prompt took. The step counts are host decisions, so they
reproduce on a CPU what the GPU run does (benchmarks/history/gated_delta.md, session 11).
"""

from __future__ import annotations

import collections
import sys

import numpy as np

BINS = [0, 64, 256, 512, 768, 1000, 1 << 30]


def run_logged(argv, prog: str, on_batch, begin, end) -> int:
    """Configuration argv[0] with rag options argv[1:] in this process (as the bench's worker
    does), `on_batch(batch)` after every Scheduler.schedule, `begin()` before each workload run
    and `end(salt)` after it (its report)."""
    import argparse

    from benchmarks import rag_bench, rag_runs
    from serving.scheduler import Scheduler
    schedule, drive = Scheduler.schedule, rag_runs.drive

    def logged_schedule(self):
        batch = schedule(self)
        on_batch(batch)
        return batch

    def logged_drive(engine, prompts, sp, **kw):
        begin()
        out = drive(engine, prompts, sp, **kw)
        end(kw.get("salt"))
        return out

    Scheduler.schedule, rag_runs.drive = logged_schedule, logged_drive
    parser = argparse.ArgumentParser(prog=prog)
    rag_bench.add_parser(parser)
    rag_runs.run_config(argv[0], parser.parse_args(argv[1:]))
    return 0


def main(argv) -> int:
    steps, prefill_steps = [], collections.Counter()

    def on_batch(batch):
        steps.append((sum(len(e.token_idx) for e in batch), len(batch)))
        for e in batch:
            if len(e.token_idx) and int(e.token_idx[0]) < e.seq.num_prompt_tokens:
                prefill_steps[e.seq.seq_id] += 1

    def begin():
        steps.clear()
        prefill_steps.clear()

    def end(salt):
        rows, seqs = np.array(steps).T
        per_request = np.bincount(list(prefill_steps.values())).tolist()
        print(f"{salt}: {len(rows)} steps, rows per step {rows.mean():.0f} "
              f"(histogram over {BINS[1:-1]}: {np.histogram(rows, BINS)[0].tolist()}), "
              f"sequences per step {seqs.mean():.2f}, prefill steps per request "
              f"{np.mean(list(prefill_steps.values())):.2f} (count by steps: {per_request})",
              flush=True)
    return run_logged(argv, "python -m benchmarks.rag_steps", on_batch, begin, end)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
