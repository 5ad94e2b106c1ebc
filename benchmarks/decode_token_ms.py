"""Milliseconds a decode token through `LLM.generate`, and the host ms of its dispatch.

    python -m benchmarks.decode_token_ms [--model qwen3_5_0_8b]
        [--options '{"max_model_len": 1024}'] [--name NAME] [--repeats 5] [--form NAME=0|1,...]

One engine (no warm-up), one 64-token prompt, greedy, EOS ignored: after an untimed pair,
`repeats` times generate with max_tokens 2 and 34; ms a token = (t34 - t2) / 32, median. The
dispatch column is the runner's compiled-step call (`ModelRunner._dispatch`) over the same 32
tokens: under async scheduling it overlaps the device, so a token near the dispatch means the
host bounds it. Run one process per setting (XLA flags, allocator, `--form`: program switches,
benchmarks/program_forms.py) to A/B them on one host (benchmarks/runs/s42_device.sh,
s42b_device.sh). Prints one line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_5_0_8b")
    ap.add_argument("--options", default="{}", help="engine options as JSON")
    ap.add_argument("--name", default="", help="label of the printed line")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--form", default="", help="program switches NAME=0|1,... set for the run")
    args = ap.parse_args(argv)

    from benchmarks.program_forms import program_form
    with program_form(args.form, flag="--form"):
        return _run(args)


def _run(args) -> int:
    import jax

    from minipic_jax import LLM, SamplingParams
    opts = json.loads(args.options)
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=dtype, seed=0, warmup=False, **opts)
    start = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    spent = [0.0]
    inner = runner._dispatch

    def dispatch(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    runner._dispatch = dispatch
    prompt = {"prompt_token_ids": list(range(1, 65))}

    def timed(n: int) -> tuple[float, float]:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        spent[0] = 0.0
        t = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t, spent[0]

    timed(2)
    timed(34)
    per = []
    for _ in range(args.repeats):
        (w2, d2), (w34, d34) = timed(2), timed(34)
        per.append(((w34 - w2) / 32 * 1e3, (d34 - d2) / 32 * 1e3))
    token = statistics.median(p[0] for p in per)
    disp = statistics.median(p[1] for p in per)
    print(f"{args.name or args.model}: {token:.3f} ms a decode token, dispatch {disp:.3f} ms "
          f"(min {min(p[0] for p in per):.3f}; blocks {llm.config.num_kv_blocks}; start "
          f"{start:.1f} s; {jax.devices()[0].device_kind}; form {args.form or '-'}; {opts})",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
