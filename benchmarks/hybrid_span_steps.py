"""Per-step breakdown of `minipic-bench hybrid-spans` calls (`--steps`): the engine steps a call
ran and where its wall time went (issue 29: the reordered call's 111 ms on an H100).

Bench-only instrumentation: `StepTrace(llm).attach()` wraps, on the engine's own objects (instance
attributes, put back by `detach`), LLMEngine.step, ModelRunner.launch / _dispatch / fetch, the
page zeroer's fill, the compose inputs' build and the cache manager's admit, before_launch and
after_read_back. Nothing in serving/ changes, so an engine without a trace pays nothing; with one,
a few Python calls and clock reads per step, and no device sync unless `sync`. One row per
engine.step() call:

  kind         the step it launched: prefill / mixed / decode (rows with prompt tokens / both
               kinds / generated tokens only), its variant (plain; span: a span step without a
               span-map pool; warm: with the pool, `+capN` when N of its rows capture a span
               map; `+compose(R)`: the compose program of R chain rows ran before it:
               serving/hybrid/span_compose.py) and its buckets t (tokens) / s (sequences);
               `read-back`: a step() that launched nothing (async: it read back the last step);
               decode-only: the engine's separate decode variant (runner.separate_decode)
  rows, tokens the batch's sequences and query tokens
  first_uses   programs (the step, its composition) dispatched for the first time since the
               trace was attached (after the warm-up, whose empty steps ran each once): a cost
               that only such rows pay is a first use of the program on real inputs
  host_ms      step() entry to the step's dispatch: scheduling (admit_ms: cache admission;
               moves_ms: lower-tier page copies and checkpoint / span-map slot moves) and the
               input build (compose_build_ms, zero_ms: page zeroing's fill, compose_ms: the
               compose program's dispatch call)
  dispatch_ms  the jitted step's call (argument handling, launch)
  post_ms      the rest of step() less its read-backs (read_ms: async scheduling reads back
               the step the previous call launched): frontiers, tokens applied, outputs
               (copies_ms: host-tier pages read into numpy after a read-back)
  step_ms      the whole step() call
  wait_ms      blocked reading back this row's step (whichever step() call read it)
  ready_ms     the step's dispatch to its tokens on the host (fetch returned): its wall from
               dispatch to result ready when the fetch waited; an upper bound when it did not
  busy_ms      ready less the later of its first dispatch and the previous step's ready: its
               device time (composition included) when both read-backs waited (`busy_ms`)
  compose_dev_ms, step_dev_ms   only with `sync`: dispatch to ready of the compose program and of
               the step, each waited for right after its dispatch (exact device walls; the host
               then no longer overlaps the device, so the call's wall grows)

Per call also `before_ms` (generate's entry to its first step(): prompt ids, request checks,
queueing), `between_ms` (the generate loop between step() calls) and `after_ms` (the last step()
to the return: span store flush, outputs in order); `gc_ms` (rows and outside): Python's
collector pauses (gc.callbacks).
"""

from __future__ import annotations

import gc
import time

import jax

TIMED = ("admit_ms", "moves_ms", "compose_build_ms", "zero_ms", "compose_ms", "copies_ms",
         "gc_ms")
SUMMED = ("first_uses", "rows", "tokens", "host_ms", "dispatch_ms", "read_ms", "post_ms", "step_ms",
          "wait_ms", "ready_ms", "busy_ms", "compose_dev_ms", "step_dev_ms") + TIMED


class StepTrace:
    """Rows of the engine.step() calls between `begin()` and `end(wall_s)` (module doc)."""

    def __init__(self, llm, sync: bool = False, clock=time.perf_counter):
        self.engine = llm.llm_engine
        self.sync, self.clock = sync, clock
        self._saved: list = []
        self._row: dict | None = None
        self._rows: list[dict] = []
        self._dispatched: dict = {}  # id(step output) -> (its row, dispatch time)
        self._gc_outside = 0.0
        self._seen: set = set()  # programs (static arguments) dispatched since attach

    # -- wrapping ------------------------------------------------------------------------------
    def attach(self) -> "StepTrace":
        eng = self.engine
        runner, cache = eng.runner, eng.cache
        self._wrap(eng, "step", self._step)
        self._wrap(runner, "launch", self._launch)
        self._wrap(runner, "_dispatch", self._dispatch)
        self._wrap(runner, "fetch", self._fetch)
        self._wrap(runner.zeroer, "fill", self._timed("zero_ms"))
        self._wrap(runner.composer, "build", self._timed("compose_build_ms"))
        self._wrap(cache, "admit", self._timed("admit_ms"))
        self._wrap(cache, "before_launch", self._timed("moves_ms"))
        self._wrap(cache, "after_read_back", self._timed("copies_ms"))
        gc.callbacks.append(self._gc)
        return self

    def _gc(self, phase: str, info: dict) -> None:
        """Python's collector pauses: charged to the step() call they fall in, else the call."""
        if phase == "start":
            self._gc_start = self.clock()
            return
        seconds = self.clock() - getattr(self, "_gc_start", self.clock())
        if self._row is not None:
            self._add("gc_ms", seconds)
        else:
            self._gc_outside += 1e3 * seconds

    def detach(self) -> None:
        """Put every wrapped method back (the engine is as it was)."""
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        for obj, name, had, old in reversed(self._saved):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._saved = []

    def _wrap(self, obj, name: str, make) -> None:
        had = name in vars(obj)
        self._saved.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, make(getattr(obj, name)))

    def _timed(self, key: str):
        def make(inner):
            def timed(*args, **kwargs):
                t0 = self.clock()
                try:
                    return inner(*args, **kwargs)
                finally:
                    self._add(key, self.clock() - t0)
            return timed
        return make

    def _add(self, key: str, seconds: float) -> None:
        if self._row is not None:
            self._row[key] = self._row.get(key, 0.0) + 1e3 * seconds

    # -- the wrappers --------------------------------------------------------------------------
    def _step(self, inner):
        def step():
            row = self._row = {"kind": "read-back", "rows": 0, "tokens": 0,
                               "start": self.clock()}
            try:
                return inner()
            finally:
                row["end"] = self.clock()
                self._finish(row)
                self._rows.append(row)
                self._row = None
        return step

    def _finish(self, row: dict) -> None:
        phases = {k: 1e3 * v for k, v in self.engine._timer.seconds.items()}
        row["step_ms"] = 1e3 * (row["end"] - row["start"])
        row["host_ms"] = phases["schedule"] + phases["build"]
        row["dispatch_ms"] = phases["dispatch"]
        row["read_ms"] = phases["device_wait"]  # this call's read-backs (of any step)
        row["post_ms"] = phases["overlap"] + phases["post"]

    def _launch(self, inner):
        def launch(batch, **kw):
            row = self._row
            if row is not None:
                prefill = sum(_is_prefill(e) for e in batch)
                row["kind"] = ("decode" if not prefill else
                               "prefill" if prefill == len(batch) else "mixed")
                row["rows"] = len(batch)
                row["tokens"] = sum(e.token_idx.size for e in batch)
            handle = inner(batch, **kw)
            if row is not None:
                row["variant"] = self._variant(row)
            return handle
        return launch

    def _variant(self, row: dict) -> str:
        runner = self.engine.runner
        ints, _, kw = runner.last_inputs
        name = "decode-only" if kw.get("decode_only") else "plain"
        if kw.get("spans"):
            name = "warm" if runner.span_pool is not None else "span"
            caps = _captures(runner, ints, kw) if name == "warm" else 0
            name += f"+cap{caps}" if caps else ""
        if "compose_rows" in row:
            name += f"+compose({row['compose_rows']})"
        return f"{name} t={kw['t']} s={kw['s']}"

    def _dispatch(self, inner):
        def dispatch(ints, floats, use_prev, kw):
            row, runner = self._row, self.engine.runner
            compose = bool(kw.get("compose"))
            key = tuple(sorted((k, repr(v)) for k, v in kw.items()))
            first, t0 = key not in self._seen, self.clock()
            self._seen.add(key)
            out = inner(ints, floats, use_prev, kw)
            t1 = self.clock()
            if row is None:
                return out
            row["first_uses"] = row.get("first_uses", 0) + first
            if compose:
                row["compose_ms"] = row.get("compose_ms", 0.0) + 1e3 * (t1 - t0)
                row["compose_rows"] = kw["compose"][0]
                row["_first"] = t0
                if self.sync:
                    jax.block_until_ready(runner.cache)
                    row["compose_dev_ms"] = 1e3 * (self.clock() - t0)
                return out
            self._dispatched[id(out)] = (row, t0)
            row.setdefault("_first", t0)  # the step's first program (its composition, if any)
            if self.sync:
                jax.block_until_ready(out)
                row["step_dev_ms"] = 1e3 * (self.clock() - t0)
            return out
        return dispatch

    def _fetch(self, inner):
        def fetch(handle):
            t0 = self.clock()
            out = inner(handle)
            t1 = self.clock()
            hit = self._dispatched.pop(id(handle[0]), None)
            if hit is not None:  # charged to the step read back, whichever step() reads it
                row = hit[0]
                row["wait_ms"] = row.get("wait_ms", 0.0) + 1e3 * (t1 - t0)
                row["ready_ms"] = 1e3 * (t1 - hit[1])
                row["_ready"] = t1
            return out
        return fetch

    # -- a call --------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a call: rows from here on, its clock from now."""
        self._rows, self._dispatched, self._gc_outside = [], {}, 0.0
        self._call_start = self.clock()

    def end(self) -> dict:
        """The call's rows (module doc), their sums by kind and the time outside the steps."""
        end, rows = self.clock(), self._rows
        gaps = [b["start"] - a["end"] for a, b in zip(rows, rows[1:])]
        outside = {"before_ms": 1e3 * ((rows[0]["start"] if rows else end) - self._call_start),
                   "between_ms": 1e3 * sum(gaps),
                   "after_ms": 1e3 * (end - rows[-1]["end"]) if rows else 0.0,
                   "gc_ms": self._gc_outside}
        busy_ms(rows)
        for r in rows:
            r["start_ms"] = 1e3 * (r["start"] - self._call_start)
            for k in ("start", "end", "_first", "_ready"):
                r.pop(k, None)
        return {"steps": rows, "by_kind": by_kind(rows), "outside": outside}


def busy_ms(rows: list[dict]) -> None:
    """`busy_ms` of each launched step read back: its tokens' arrival less the later of its first
    dispatch (composition included) and the previous step's tokens' arrival (the device runs the
    steps in order). Its device time when both read-backs waited; a lower bound otherwise."""
    prev = None
    for r in rows:
        if "_ready" not in r:
            continue
        r["busy_ms"] = 1e3 * (r["_ready"] - max(r["_first"], prev if prev is not None
                                                  else r["_first"]))
        prev = r["_ready"]


def _is_prefill(entry) -> bool:
    """A row holding prompt tokens (a chunk, or a restore: the scheduler's prefill rows)."""
    idx = entry.token_idx
    return idx.size > 1 or int(idx[0]) < entry.seq.num_prompt_tokens or entry.restore_slot >= 0


def _captures(runner, ints, kw) -> int:
    """Rows of a warm span step that capture a span map (cap_slot >= 0)."""
    from serving.step.step_inputs import layout
    spec, _ = layout(kw["t"], kw["s"], runner.nb, runner.ck_pool is not None, True, True,
                     block_size=runner.block_size, resident=runner.dev_tables.on)
    off, shape = spec["cap_slot"]
    return int((ints[off:off + shape[0]] >= 0).sum())


def kind_key(row: dict) -> str:
    return f"{row['kind']} {row.get('variant', '')}".strip()


def by_kind(rows: list[dict]) -> dict:
    """Sums of SUMMED per kind key (`n`: the steps of that kind), in order of first use."""
    out: dict = {}
    for r in rows:
        s = out.setdefault(kind_key(r), {"n": 0})
        s["n"] += 1
        for k in SUMMED:
            if k in r:
                s[k] = s.get(k, 0) + r[k]
    return out


def table_lines(trace: dict, sync: bool = False) -> list[str]:
    """A compact table of one call: a line per kind (sums), then the time outside the steps.
    A row's step() is host + disp + read + post, read being the read-backs that call made (async
    scheduling: of the step before), while wait is charged to the step read: the first decode
    row's step() holds the prefill step's wait (H100, session 41: 3.75 ms of the reordered
    call's decode rows was the prefill step's device time)."""
    cols = ["host", "disp", "read", "post", "step()", "wait", "ready", "busy", "admit", "moves",
            "cmp_b", "cmp_d", "zero"] + (["cmp_dev", "dev"] if sync else [])
    keys = ["host_ms", "dispatch_ms", "read_ms", "post_ms", "step_ms", "wait_ms", "ready_ms",
            "busy_ms", "admit_ms", "moves_ms", "compose_build_ms", "compose_ms", "zero_ms"] + (
        ["compose_dev_ms", "step_dev_ms"] if sync else [])
    lines = [f"    {'kind':<36} {'n':>2} {'1st':>3} {'tok':>5} "
             + " ".join(f"{c:>7}" for c in cols)]
    for kind, s in trace["by_kind"].items():
        lines.append(f"    {kind[:36]:<36} {s['n']:2d} {s.get('first_uses', 0):3d} "
                     f"{s['tokens']:5d} "
                     + " ".join(f"{s.get(k, 0.0):7.2f}" for k in keys))
    o = trace["outside"]
    gc_ms = o["gc_ms"] + sum(s.get("gc_ms", 0.0) for s in trace["by_kind"].values())
    lines.append(f"    outside steps: before {o['before_ms']:.2f} ms, between "
                 f"{o['between_ms']:.2f}, after {o['after_ms']:.2f}; Python GC in the call "
                 f"{gc_ms:.2f} ms")
    return lines
