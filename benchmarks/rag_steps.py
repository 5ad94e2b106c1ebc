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


def main(argv) -> int:
    import argparse

    from benchmarks import rag_bench, rag_runs
    from serving.scheduler import Scheduler
    steps, prefill_steps = [], collections.Counter()
    schedule, drive = Scheduler.schedule, rag_runs.drive

    def logged_schedule(self):
        batch = schedule(self)
        steps.append((sum(len(e.token_idx) for e in batch), len(batch)))
        for e in batch:
            if len(e.token_idx) and int(e.token_idx[0]) < e.seq.num_prompt_tokens:
                prefill_steps[e.seq.seq_id] += 1
        return batch

    def logged_drive(engine, prompts, sp, **kw):
        steps.clear()
        prefill_steps.clear()
        out = drive(engine, prompts, sp, **kw)
        rows, seqs = np.array(steps).T
        per_request = np.bincount(list(prefill_steps.values())).tolist()
        print(f"{kw.get('salt')}: {len(rows)} steps, rows per step {rows.mean():.0f} "
              f"(histogram over {BINS[1:-1]}: {np.histogram(rows, BINS)[0].tolist()}), "
              f"sequences per step {seqs.mean():.2f}, prefill steps per request "
              f"{np.mean(list(prefill_steps.values())):.2f} (count by steps: {per_request})",
              flush=True)
        return out

    Scheduler.schedule, rag_runs.drive = logged_schedule, logged_drive
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rag_steps")
    rag_bench.add_parser(parser)
    args = parser.parse_args(argv[1:])
    rag_runs.run_config(argv[0], args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
