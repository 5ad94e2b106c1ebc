"""One engine step compiled with other XLA compiler options, timed in the same process (issue 28).

`compare(runner, ints, floats, kw, settings)` takes the inputs of a step the runner ran
(`ModelRunner.last_inputs`), compiles that step's variant again for each Config.compilation
command-buffer setting (serving/step/compile_options.py: "off", "on", a list of XLA command-buffer
types), puts it in the runner's variant table in place of the engine's own and replays the step
(the engine's own executable first, as row "engine"): per setting the ms until the call returns
(`dispatch_ms`: the host's launch work; `dispatch_probe`, also rag_ttft's), a lone step's wall
(`step_alone_ms`), the device kernels per step and their busy ms (a jax.profiler trace; kernels
inside a CUDA graph are still listed one by one), the profiler's lines (graph launches show there)
and the command-buffer computations XLA outlined into the program (`command_buffers`). The engine's
executable is put back after each.

Options are given to `Lowered.compile` over those of the engine's own jit, so run it in an engine
whose step_command_buffer is "xla" (the default today): "xla" is then the engine's row.
`rag --configs ttft --ttft-profile 1 --ttft-command-buffers off on` runs it on the cached step.
"""

from __future__ import annotations

import re
import statistics
import time


def compare(runner, ints, floats, kw, settings, *, repeats: int = 5, profile: bool = True,
            platform: str | None = None) -> list[dict]:
    """A row per setting (see the module doc); `platform` (default: jax.default_backend())
    decides which options a setting means, as in the engine."""
    import jax

    from serving.step.compile_options import step_compiler_options

    steps = runner._step  # serving/step/step_executables.StepExecutables
    use_prev = runner.config.async_scheduling
    args = runner._args(ints, floats, use_prev, kw)
    key = steps._key(args, kw)
    own = steps._table[key]
    rows = []
    for setting in (None, *settings):  # None: the engine's own executable
        row = {"setting": "engine" if setting is None else setting}
        t0 = time.perf_counter()
        try:
            if setting is None:
                exe, row["options"] = own, steps.compiler_options
            else:
                row["options"] = step_compiler_options(setting, platform or jax.default_backend())
                exe = steps.jitted.trace(*args, **kw).lower().compile(
                    compiler_options=row["options"] or None)
            row.update(compile_s=time.perf_counter() - t0, **command_buffers(exe))
            steps._table[key] = exe
            steps._spelled.clear()  # the callers' spellings point at the table's old entries
            _measure(runner, ints, floats, use_prev, kw, repeats, profile, row)
        except Exception as err:  # noqa: BLE001 - one setting failing (a compile, the profiler on
            row["error"] = f"{type(err).__name__}: {err}"[:400]  # graphs) keeps the others
        finally:
            steps._table[key] = own
            steps._spelled.clear()
        rows.append(row)
    return rows


def _measure(runner, ints, floats, use_prev, kw, repeats, profile, row) -> dict:
    import jax

    from benchmarks.timing import blocked_ms, profile_kernels

    def call():
        return runner._dispatch(ints, floats, use_prev, kw)
    row["step_alone_ms"] = blocked_ms(call, repeats)["ms"]
    row.update(dispatch_probe(runner, ints, floats, use_prev, kw, repeats))
    row["sampled"] = jax.device_get(call()).tolist()
    if profile:
        prof = profile_kernels(call, steps=3, top=5)
        row.update({k: prof[k] for k in ("kernels_per_step", "kernel_busy_ms_per_step",
                                         "first_to_last_kernel_ms_per_step", "lines")})
    return row


def command_buffers(exe) -> dict:
    """The command-buffer computations XLA outlined into a compiled program (its text names each
    `command_buffer...`; none on CPU) and every mention of one (their calls too)."""
    try:
        text = exe.as_text()
    except Exception:  # noqa: BLE001 - a side figure (a loaded executable may have no text)
        return {"command_buffers": None}
    return {"command_buffers": len(command_buffer_computations(text)),
            "command_buffer_mentions": text.count("command_buffer")}


def command_buffer_computations(hlo_text: str) -> list[str]:
    """The names of the computations XLA's command-buffer scheduling outlined (a compiled
    program's text defines each as `%command_buffer... (`)."""
    return re.findall(r"^%?(command_buffer[\w.\-]*)\s*\(", hlo_text, re.M)


def table(rows: list[dict]) -> list[str]:
    """`compare`'s rows as the lines of a short table."""
    head = (f"{'step_command_buffer':>22} {'call returns':>12} {'alone':>8} {'busy':>8} "
            f"{'kernels':>8} {'graphs':>6}")
    out = [head]
    for r in rows:
        label = str(r["setting"])
        label = label if len(label) <= 22 else "..." + label[-19:]
        if "dispatch_ms" not in r:
            out.append(f"{label:>22} failed: {r.get('error')}"[:200])
            continue
        busy = r.get("kernel_busy_ms_per_step")
        out.append(f"{label:>22} {r['dispatch_ms']:9.2f} ms {r['step_alone_ms']:5.2f} ms "
                   f"{'-' if busy is None else f'{busy:5.2f} ms':>8} "
                   f"{r.get('kernels_per_step', 0):8.0f} {str(r.get('command_buffers')):>6}")
    return out


def dispatch_probe(r, ints, floats, use_prev: bool, kw, repeats: int) -> dict:
    """Where the step call's own host time goes (issue 28's `step_call`; rag_ttft's replay
    reports it too): the median ms until the call returns (each call waited for before the
    next), with the host int/float buffers as the engine passes them and with the same values
    already on device (the difference is the host->device copy of the inputs: the [S, NB] block
    tables are most of `int_bytes`)."""
    import jax

    def returns_ms(a, b) -> float:
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            out = r._dispatch(a, b, use_prev, kw)
            times.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
        return 1e3 * statistics.median(times[2:])

    on_host = returns_ms(ints, floats)
    dev = jax.block_until_ready(jax.device_put((ints, floats)))
    return {"dispatch_ms": on_host, "dispatch_inputs_on_device_ms": returns_ms(*dev),
            "int_bytes": int(ints.nbytes)}


def ttft_summary(runs: dict) -> list[str]:
    """Lines of one table over `rag --configs ttft` results, {label: rag_bench.json path}: per
    engine setting the cold and cached TTFT through LLM.generate, the host time of a cached call,
    its step call's return (`step_call`), the replayed step's call return, lone wall and
    kernels and command-buffer computations, then any in-process rows (`compare`) of that run."""
    import json
    import pathlib

    out = [f"{'run':>10} {'cold':>8} {'cached':>7} {'ratio':>6} {'host':>6} {'step_call':>9} "
           f"{'replay call':>11} {'alone':>6} {'busy':>6} {'kernels':>7} {'graphs':>6}  (ms)"]
    extra = []
    for label, path in runs.items():
        try:
            res = next(r for r in json.loads(pathlib.Path(path).read_text())["results"]
                       if r.get("config") == "ttft")
            g, prof = res["generate"], res.get("cached_step_profile") or {}
            calls = [r["parts_ms"]["step_call"] for r in g["rows"] if not r["cold"]]
        except (OSError, StopIteration, KeyError, ValueError) as err:
            out.append(f"{label:>10} no result ({type(err).__name__}: {err})"[:200])
            continue
        call = statistics.median(calls) if calls else float("nan")
        out.append(f"{label:>10} {g['cold_ms']:8.1f} {g['cached_ms']:7.2f} "
                   f"{g['cold_over_cached']:6.1f} {g['cached_host_ms']:6.2f} {call:9.2f} "
                   f"{prof.get('dispatch_ms', float('nan')):11.2f} "
                   f"{prof.get('step_alone_ms', float('nan')):6.2f} "
                   f"{prof.get('kernel_busy_ms_per_step', float('nan')):6.2f} "
                   f"{prof.get('kernels_per_step', float('nan')):7.0f} "
                   f"{str(prof.get('hlo_ops', {}).get('command_buffers', '-')):>6}")
        if prof.get("command_buffer_ab"):
            extra += [f"in-process A/B of run {label}'s cached step:"]
            extra += table(prof["command_buffer_ab"])
    return out + extra
