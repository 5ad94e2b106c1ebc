"""The host side of pure decode steps with the jitted step stubbed out (any backend, seconds).

`python -m benchmarks.decode_host_profile [--batch 128 --ctx 2048 --steps 40 --reps 5
--profile N]`: an engine as the H200 decode measurement builds it (`minipic-bench engine
--max-num-batched-tokens 512 --min-token-bucket 128`, async loop; a tiny preset so start-up
takes seconds), `batch` sequences primed at context `ctx`, then `steps` decode steps per rep.
Prints per rep the host ms per step (schedule / build / dispatch / overlap / post: medians over
the steps; work = schedule + build + post, its median as `decode_host_work_ms` and its mean;
wall on an outside clock) and the minimum over reps (the CPU is noisy: compare minima, and
alternate processes when comparing two trees). With --profile N, a
cProfile of one more rep, the N functions with the most own time (microseconds per step).
Only the engine's public pieces are used, so the same file runs against older trees.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time

PARTS = ("schedule", "build", "dispatch", "overlap", "post")


class Pending:
    """A stubbed step's output that is ready only at `ready_at` (perf_counter): reading it
    (np.asarray, as ModelRunner.fetch does) spins until then, like a wait for the device."""

    def __init__(self, out, ready_at: float):
        self.out, self.ready_at = out, ready_at

    def __array__(self, dtype=None, copy=None):
        while time.perf_counter() < self.ready_at:
            pass
        return self.out


class DeviceBoundStub:
    """StubStep whose steps take `device_ms` each on an emulated device that runs them one after
    another from their dispatch: the loop is device-bound as on the H200 (13.7 ms steps)."""

    def __init__(self, stub, device_ms: float):
        self.stub, self.seconds, self.free_at = stub, device_ms / 1e3, 0.0

    def __call__(self, *args, **kwargs):
        cache, out, *rest = self.stub(*args, **kwargs)
        self.free_at = max(self.free_at, time.perf_counter()) + self.seconds
        return (cache, Pending(out, self.free_at), *rest)


def build_engine(batch: int, ctx: int, model: str, device_ms: float = 0.0):
    """The decode benchmark's engine (tiny preset, float32), its jitted step stubbed (with
    device_ms, each step's outputs are ready that long after the previous step's)."""
    from benchmarks.engine_host import StubStep
    from minipic_jax import LLM
    bs = 16
    llm = LLM(model, dtype="float32", seed=0, max_num_seqs=batch,
              max_num_batched_tokens=512, max_model_len=ctx + 64, block_size=bs,
              num_kv_blocks=batch * -(-(ctx + 64) // bs) + 64, min_token_bucket=128,
              async_scheduling=True)
    engine = llm.llm_engine
    stub = StubStep(engine.vocab_size)
    engine.runner._step = DeviceBoundStub(stub, device_ms) if device_ms else stub
    return engine


def primed(engine, batch: int, ctx: int, steps: int, rng) -> None:
    """`batch` sequences at context `ctx` (room for `steps` + 2 more tokens), past their first
    two decode steps (buffers, allocator), the heap frozen as engine.warmup() leaves it."""
    from benchmarks.engine_workload import prime_decode
    prime_decode(engine, batch, ctx, steps + 2, rng)
    engine.step()
    engine.step()
    gc.collect()
    gc.freeze()


def retire(engine, batch: int) -> None:
    """Abort the primed sequences and read back the step still in flight."""
    for i in range(batch):
        engine.abort_request(f"decode-{i}")
    while engine.has_unfinished():
        engine.step()
    engine.step()


def timed_rep(engine, steps: int, prof=None) -> dict:
    """Host ms per step of `steps` decode steps: per part the median over the steps (as
    `minipic-bench engine` reports decode_host_work_ms; a block-allocation step every block_size
    steps is the outlier the median leaves out), work = schedule + build + post (median), and
    their means over the steps (mean_work; wall: engine.step() calls on an outside clock)."""
    import numpy as np
    st = engine.stats
    per_step = {p: [] for p in PARTS + ("step_time",)}
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        before = {p: getattr(st, p) for p in PARTS + ("step_time",)}
        engine.step()
        for p in before:
            per_step[p].append(1e3 * (getattr(st, p) - before[p]))
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t
    work = np.add(np.add(per_step["schedule"], per_step["build"]), per_step["post"])
    out = {p: float(np.median(v)) for p, v in per_step.items()}
    out["work"] = float(np.median(work))  # decode_host_work_ms
    out["mean_work"] = float(np.mean(work))
    out["step_wall"] = out.pop("step_time")  # decode_step_wall_ms: the timed part of step()
    out["wall"] = 1e3 * wall / steps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--steps", type=int, default=40,
                   help="decode steps per rep (at most 60: max_model_len is ctx + 64)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--model", default="tiny_llama3")
    p.add_argument("--device-ms", type=float, default=0.0,
                   help="emulate a device step of this many ms (a device-bound loop, as on the "
                        "H200: step_wall is then the device step less the host work step() "
                        "does outside its timer)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile one more rep; print the N functions with the most own time")
    args = p.parse_args(argv)
    import numpy as np

    engine = build_engine(args.batch, args.ctx, args.model, args.device_ms)
    rng = np.random.default_rng(0)
    reps = []
    for _ in range(args.reps):
        primed(engine, args.batch, args.ctx, args.steps, rng)
        reps.append(timed_rep(engine, args.steps))
        retire(engine, args.batch)
    for r in reps:
        print("rep " + " ".join(f"{k} {v:.3f}" for k, v in r.items()))
    best = {k: min(r[k] for r in reps) for k in reps[0]}
    print("min " + " ".join(f"{k} {v:.3f}" for k, v in best.items()))
    if args.profile:
        prof = cProfile.Profile()
        for _ in range(args.reps):
            primed(engine, args.batch, args.ctx, args.steps, rng)
            timed_rep(engine, args.steps, prof)
            retire(engine, args.batch)
        n = args.steps * args.reps
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.profile]
        print(f"{'calls/step':>10} {'own us/step':>11} {'cum us/step':>11}  function")
        for (file, line, name), (_, ncalls, tt, ct, _) in rows:
            print(f"{ncalls / n:10.1f} {1e6 * tt / n:11.1f} {1e6 * ct / n:11.1f}  "
                  f"{'/'.join(file.split('/')[-2:])}:{line}:{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
