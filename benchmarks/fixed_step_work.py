"""Issue 29: the part of a hybrid prefill step that does not scale with its tokens, counted on the
CPU (`--count`) and timed on a device (`--time`).

--count builds the engine's own step program (ModelRunner._step_body, the plain prefill variant of
a token bucket, abstract weights: benchmarks/lower_time.build_runner) for `qwen3_5_0_8b` widths
(vocab cut to 1,024) with 1 GDN + 1 attention layer, 2 + 1 and 1 + 2, compiles it for the CPU with
the GDN Pallas pipeline stubbed (benchmarks/span_step_work.stub_kernels: an opaque callback of
the kernel's shapes) and reads `compiled.cost_analysis()`: per GDN layer, per attention layer and
the step extrapolated to the model's 18 + 6, for each seats x max_model_len x token bucket, with
the checkpoint pool attached (the engine's default: prefix caching on) and without. The CPU's
attention is the XLA path (the GPU runs a kernel: its bytes here are not the GPU's); the GDN
layer's XLA work around the kernel is the GPU's. `--top N` lists the N largest values of one
compiled program (where the bytes are).

--time (on a device) builds an LLM per seats x max_model_len (warmup off, a fixed KV pool, prefix
caching as given), runs one prompt per token bucket (max_tokens 1: its prefill is one plain step)
and replays that step REPS times, each waited for: the median ms per bucket.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.fixed_step_work --count
    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.fixed_step_work --top 8 --seats 64 \\
        --max-model-len 25600 --tokens 128
    PYTHONPATH=. python -m benchmarks.fixed_step_work --time --seats 64 --max-model-len 25600
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import re
import statistics
import time

import numpy as np

PRESET, CK_SLOTS = "qwen3_5_0_8b", 16
# --ck-forms: qwen3_5.CHECKPOINTS_FIRST (session 25 also timed a per-layer pool store: RESULTS.md)
CK_FORMS = {"barrier": True, "old": False}
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8}


def model_cfg(gdn: int, attn: int, preset: str = PRESET, vocab: int | None = 1024):
    """`preset` with `gdn` GDN then `attn` attention layers (vocab cut to `vocab`)."""
    from configs.presets import PRESETS
    base = PRESETS[preset]
    kinds = ("linear_attention",) * gdn + ("full_attention",) * attn
    return dataclasses.replace(base, vocab_size=vocab or base.vocab_size,
                               num_layers=len(kinds), layer_types=kinds)


def compiled_step(seats: int, max_model_len: int, t: int, gdn: int, attn: int, ckpt: bool):
    """The CPU-compiled plain prefill step of bucket t (the runner's own program)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.lower_time import abstract, build_runner
    from serving.hybrid import checkpoint_pool

    r = build_runner(model_cfg(gdn, attn), "bfloat16", max_num_seqs=seats,
                     max_num_batched_tokens=1024, min_token_bucket=128,
                     max_model_len=max_model_len, block_size=16,
                     num_kv_blocks=max(seats * max_model_len // 64, 1024))
    r.gdn_impl = "pallas_fused_interpret"  # the kernel path (stubbed: stub_kernels)
    if ckpt:
        lay = checkpoint_pool.state_layout(r.family, r.mcfg, 16, jnp.bfloat16)
        r.ck_pool = jax.eval_shape(lambda: checkpoint_pool.allocate(lay, CK_SLOTS))
    ints, floats, kw = next(st for st in r.warmup_steps()
                            if st[2]["t"] == t and not st[2]["decode_only"])
    args = abstract(r._args(ints, floats, r.config.async_scheduling, kw))
    return r._step.jitted.trace(*args, **kw).lower().compile()


def cost(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) of a compiled program."""
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))


def largest_values(compiled, n: int) -> list[tuple[float, str]]:
    """The n largest values the compiled program's instructions make: (bytes, 'op dtype[dims]')."""
    out = []
    pat = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
    for line in compiled.as_text().splitlines():
        m = pat.match(line)
        if m:
            dims = [int(x) for x in m.group(2).split(",") if x]
            size = int(np.prod(dims)) * _DTYPE_BYTES.get(m.group(1), 4)
            out.append((size, f"{m.group(3)} {m.group(1)}[{m.group(2)}]"))
    return sorted(out, reverse=True)[:n]


def count_point(seats: int, max_model_len: int, t: int, ckpt: bool) -> dict:
    """Flops / bytes per GDN layer, per attention layer and of the 18 + 6 layer step."""
    c = {}
    for gdn, attn in ((1, 1), (2, 1), (1, 2)):
        with contextlib.redirect_stdout(io.StringIO()):
            c[gdn, attn] = cost(compiled_step(seats, max_model_len, t, gdn, attn, ckpt))
    per_gdn = [c[2, 1][i] - c[1, 1][i] for i in (0, 1)]
    per_attn = [c[1, 2][i] - c[1, 1][i] for i in (0, 1)]
    step = [c[1, 1][i] + 17 * per_gdn[i] + 5 * per_attn[i] for i in (0, 1)]
    return dict(seats=seats, max_model_len=max_model_len, t=t, ckpt=ckpt,
                gdn_gflop=per_gdn[0] / 1e9, gdn_gb=per_gdn[1] / 1e9,
                attn_gflop=per_attn[0] / 1e9, attn_gb=per_attn[1] / 1e9,
                step_gflop=step[0] / 1e9, step_gb=step[1] / 1e9)


def count_line(p: dict) -> str:
    return (f"ckpt={int(p['ckpt'])} seats={p['seats']:3d} max_model_len={p['max_model_len']:6d} "
            f"t={p['t']:5d} | per GDN layer {p['gdn_gb']:6.3f} GB {p['gdn_gflop']:6.2f} GFLOP | "
            f"per attn layer (XLA on CPU) {p['attn_gb']:6.3f} GB | step 18+6 "
            f"{p['step_gb']:7.2f} GB {p['step_gflop']:7.1f} GFLOP")


def time_point(seats: int, max_model_len: int, tokens: list[int], reps: int, caching: bool,
               preset: str, num_kv_blocks: int, decode: bool = False,
               profile_top: int = 0, small_seq_bucket: int | None = None,
               fuse_weights: bool = True) -> list[str]:
    """Device ms of the plain prefill step of each token bucket (one engine, one prompt each),
    with `decode` also of the decode step that follows it (the prompt again, max_tokens 2: its
    last step), with `profile_top` each step's costliest kernels too (a jax.profiler trace)."""
    from minipic_jax import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(preset, dtype="bfloat16", max_num_seqs=seats, max_model_len=max_model_len,
              max_num_batched_tokens=1024, num_kv_blocks=num_kv_blocks, warmup=False,
              enable_prefix_caching=caching, async_scheduling=False,
              small_seq_bucket=small_seq_bucket, fuse_weights=fuse_weights)
    runner, rng, lines = llm.llm_engine.runner, np.random.default_rng(0), []
    for t in tokens:
        ids = rng.integers(10, 500, size=t - 8).tolist()  # t - 8: the bucket is t
        for max_tokens in (1, 2) if decode else (1,):
            if max_tokens == 2:
                llm.llm_engine.reset_prefix_cache()
            llm.generate([{"prompt_token_ids": ids}],
                         SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
            kind = ("prefill", "decode")[max_tokens - 1]
            lines += _time_last_step(runner, reps, profile_top, kind,
                                     f"time {preset} seats={seats} max_model_len={max_model_len} "
                                     f"caching={int(caching)} small_seq_bucket="
                                     f"{llm.config.small_seq_bucket} fuse={int(fuse_weights)}",
                                     t0)
    return lines


def _time_last_step(runner, reps: int, profile_top: int, kind: str, label: str,
                    t0: float) -> list[str]:
    """The runner's last step replayed reps (+2) times, each waited for: a line with the median
    ms, and with profile_top the trace's summary and top kernels."""
    import jax
    ints, floats, kw = runner.last_inputs

    def call():  # _dispatch keeps the donated cache, pools and tables
        return runner._dispatch(ints, floats, False, kw)

    times = []
    for _ in range(reps + 2):
        t1 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(1e3 * (time.perf_counter() - t1))
    lines = [f"{label} {kind} t={kw['t']} s={kw['s']}: {statistics.median(times[2:]):.2f} ms/step "
             f"(min {min(times[2:]):.2f}; engine + steps {time.perf_counter() - t0:.0f} s)"]
    print(lines[-1], flush=True)
    if profile_top:
        from benchmarks.timing import profile_kernels
        prof = profile_kernels(call, top=profile_top)
        lines.append(f"profile {kind} t={kw['t']} s={kw['s']}: {prof['kernels_per_step']:.0f} "
                     f"kernels, busy {prof['kernel_busy_ms_per_step']:.2f} ms, first-to-last "
                     f"{prof['first_to_last_kernel_ms_per_step']:.2f} ms per step")
        lines += [f"profile {kind} t={kw['t']} s={kw['s']} | {k['ms_per_step']:7.3f} ms | "
                  f"{k['calls_per_step']:5.1f} | {k['name'][:70]}" for k in prof["top"]]
        print("\n".join(lines[1:]), flush=True)
    return lines


def time_forms(a, ckpt: bool, seats: int, mml: int) -> None:
    """--time: an engine per combination of the switch forms asked for (live pre-rotation,
    checkpoint form, in-place GDN decode, --forms), each set through program_forms (JAX's
    traces cleared, the switches put back after), and the Config values."""
    from benchmarks.program_forms import program_form
    for live, form, in_place, switches in itertools.product(a.live_prerotate, a.ck_forms,
                                                            a.decode_in_place, a.forms):
        fixed = {"LIVE_PREROTATE": live, "CHECKPOINTS_FIRST": int(CK_FORMS[form]),
                 "GDN_DECODE_IN_PLACE": int(in_place > 0), "GDN_DECODE_GLUE": int(in_place >= 2),
                 "GDN_DECODE_CONV": int(in_place == 3)}
        print(f"live_prerotate={live} ck_form={form} decode_in_place={in_place} "
              f"forms={switches or '-'}", flush=True)
        # --forms last: a switch it names overrides the flags' value
        with program_form(",".join([f"{k}={v}" for k, v in fixed.items()] + [switches])):
            for small in a.small_seq_bucket:
                for fuse in a.fuse_weights:
                    time_point(seats, mml, a.tokens, a.reps, ckpt, a.preset, a.num_kv_blocks,
                               a.decode, a.profile, small, bool(fuse))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fixed_step_work",
                                 description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--count", action="store_true", help="the CPU count grid (module doc)")
    mode.add_argument("--top", type=int, metavar="N", help="N largest values of one program")
    mode.add_argument("--time", action="store_true", help="device ms per step (module doc)")
    ap.add_argument("--seats", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--max-model-len", type=int, nargs="+", default=[4096, 25600])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--ckpt", type=int, nargs="+", default=[1, 0],
                    help="--count/--top: with (1) / without (0) the checkpoint pool; --time: "
                         "enable_prefix_caching (default: %(default)s)")
    ap.add_argument("--preset", default=PRESET, help="--time: the model (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=10, help="--time: replays timed (median)")
    ap.add_argument("--num-kv-blocks", type=int, default=4096, help="--time: KV pool blocks")
    ap.add_argument("--small-seq-bucket", type=int, nargs="+", default=[None],
                    help="--time: Config.small_seq_bucket values, an engine each (default: unset)")
    ap.add_argument("--fuse-weights", type=int, nargs="+", default=[1], choices=[0, 1],
                    help="--time: Config.fuse_weights values, an engine each (default: 1)")
    ap.add_argument("--live-prerotate", type=int, nargs="+", default=[1], choices=[0, 1],
                    help="--time: triton_ragged.LIVE_PREROTATE values, an engine each (0: the "
                         "whole-table key pre-rotation; default: 1)")
    ap.add_argument("--ck-forms", nargs="+", default=["barrier"], choices=list(CK_FORMS),
                    help="--time: barrier = a layer's checkpoints taken before its states are "
                         "written back (qwen3_5.CHECKPOINTS_FIRST), old = not; an engine each "
                         "(default: barrier)")
    ap.add_argument("--decode-in-place", type=int, nargs="+", default=[2], choices=[0, 1, 2, 3],
                    help="--time: the GDN decode, an engine each: 0 gather / step / scatter, 1 in "
                         "place (qwen3_5.GDN_DECODE_IN_PLACE), 2 with the layer's glue "
                         "(GDN_DECODE_GLUE), 3 and its conv (GDN_DECODE_CONV) (default: 2, the "
                         "engine's)")
    ap.add_argument("--forms", nargs="+", default=[""], metavar="NAME=0|1,...",
                    help="--time: program switch forms (benchmarks/program_forms.py), an engine "
                         "each (default: the switches as they are)")
    ap.add_argument("--decode", action="store_true", help="--time: the decode step after each too")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="--time: each step's N costliest kernels (a jax.profiler trace)")
    ap.add_argument("--row-options", metavar="FILE",
                    help="--time: kernels_pallas.row_matmul.api.OPTIONS updated from this JSON "
                         "(row_matmul_bench --sweep --best-out) before any engine starts")
    a = ap.parse_args(argv)
    if a.row_options:
        import json

        from kernels_pallas.row_matmul import api as row_api
        with open(a.row_options) as fh:
            for kernel, option in json.load(fh).items():
                row_api.OPTIONS[kernel] = row_api.OPTIONS[kernel] | option
        print(f"row_matmul options {row_api.OPTIONS}", flush=True)
    from benchmarks.program_forms import parse_form
    for form in a.forms:  # a bad name fails before any engine starts
        parse_form(form)
    if a.top:
        from benchmarks.span_step_work import stub_kernels
        stub_kernels()
        comp = compiled_step(a.seats[0], a.max_model_len[0], a.tokens[0], 1, 1, bool(a.ckpt[0]))
        print(f"flops, bytes: {cost(comp)}")
        for size, what in largest_values(comp, a.top):
            print(f"{size / 1e6:10.1f} MB  {what}")
        return 0
    for ckpt in a.ckpt:
        for seats in a.seats:
            for mml in a.max_model_len:
                if a.time:
                    time_forms(a, bool(ckpt), seats, mml)
                    continue
                from benchmarks.span_step_work import stub_kernels
                stub_kernels()
                for t in a.tokens:
                    print(count_line(count_point(seats, mml, t, bool(ckpt))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
