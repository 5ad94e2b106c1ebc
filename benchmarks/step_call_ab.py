"""Issue 28's step call, A/B on the host (any backend):

- `tables_ab`: the cached-span request (benchmarks/ttft_host.py) with the block tables resident on
  the device (serving/step/resident_tables.py) vs each step carrying its seats' [S, NB] rows;
- `leaves_ab`: the null step's call (benchmarks/null_step.py) with Llama-3.1-8B's 259 leaves vs
  its per-layer weights and/or K and V stacked over the layers (what fewer leaves would save);
- `decode_ab`: the CPU engine decoding, resident tables vs rows.

    python -m benchmarks.step_call_ab [--step null-llama8b] [--blocks 4] [--calls 3] [--real]
    python -m benchmarks.step_call_ab leaves
    python -m benchmarks.step_call_ab decode   # the CPU engine decoding, resident vs rows
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def tables_ab(argv=None) -> int:
    """Issue 28's cached-span request (benchmarks/ttft_host.py) with the null step, the block
    tables resident on the device (serving/step/resident_tables.py) vs each step carrying its
    seats' [S, NB] rows, alternating in blocks of calls (the first call of a block, which
    uploads the tables after the switch, is not counted). Prints per mode the median ms of
    the step call (`stub`), the input build, the host time, the thread's CPU time (steadier on
    a loaded machine), and the cached step's int bytes.

        python -m benchmarks.step_call_ab [--step null-llama8b] [--blocks 4] [--calls 3] [--real]
    """
    import argparse
    import statistics

    from benchmarks import null_step, ttft_host
    from minipic_jax import SamplingParams
    from serving.step import resident_tables
    p = argparse.ArgumentParser(prog="null_step")
    ttft_host.add_parser(p)
    p.add_argument("--blocks", type=int, default=4, help="blocks of calls per mode")
    p.add_argument("--real", action="store_true", help="the engine's own step (its device work "
                   "timed too), not a null one")
    p.set_defaults(step="null-llama8b", max_num_seqs=64, min_token_bucket=128, fresh_lists=True)
    args = p.parse_args(argv)
    if args.real:  # make_llm installs the null step through null_step.install: not this time
        install_null, null_step.install = null_step.install, lambda runner, shape="engine": None
        args.step = "null"
    llm = ttft_host.make_llm(args)
    if args.real:
        null_step.install, args.step = install_null, "real"
    runner, vocab = llm.llm_engine.runner, llm.llm_engine.vocab_size
    rng = np.random.default_rng(0)
    spans = [rng.integers(10, vocab - 10, args.span_tokens).tolist() for _ in range(args.spans)]
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    pt = ttft_host.instrument(llm)
    uploads, upload = [0], resident_tables.upload

    def counted(stack, mesh=None):  # a step whose changes did not fit uploads the whole array
        uploads[0] += 1
        return upload(stack, mesh)
    resident_tables.upload = counted

    def call():
        prompt = ttft_host.request(rng, spans, rng.permutation(args.spans), vocab, True)
        return ttft_host.timed_call(llm, pt, prompt, sp)
    call()  # the cold call: every block computed
    rows: dict = {"rows": [], "resident": []}
    nbytes, measured_uploads = {}, 0
    for _ in range(args.blocks):
        for mode in rows:
            runner.dev_tables.set(mode == "resident")
            call()  # after the switch: the resident mode's first step uploads the whole array
            before = uploads[0]
            rows[mode] += [call() for _ in range(args.calls)]
            measured_uploads += uploads[0] - before
            nbytes[mode] = runner.last_inputs[0].nbytes
    resident_tables.upload = upload
    print(f"null_step tables A/B ({args.step}, {args.max_num_seqs} seats, NB {runner.nb}): "
          f"median ms of {args.blocks} x {args.calls} cached calls per mode")
    print(f"{'mode':>9} {'stub':>7} {'build':>7} {'host':>7} {'cpu':>7} {'int_bytes':>10}")
    for mode, rs in rows.items():
        cols = [statistics.median(r[k] for r in rs) for k in ("stub", "build", "host",
                                                                "thread_cpu")]
        print(f"{mode:>9} " + " ".join(f"{x:7.3f}" for x in cols) + f" {nbytes[mode]:10d}")
    print(f"whole-table uploads in the measured resident calls: {measured_uploads}")
    return 0


def stacked_like(params, cache, *, layers: bool, kv: bool):
    """`llama8b_like`'s pytrees with each per-layer weight stacked over the layers ([32, ...]:
    9 param leaves, not 195) and/or K and V each one array (2 cache leaves, not 64): what the
    step call would cost if the model held them so (item 2 of issue 28's step call)."""
    from minipic_jax.models.llama import KVCache
    if layers:
        stacked = {k: jnp.stack([lay[k] for lay in params["layers"]])
                   for k in params["layers"][0]}
        params = dict(params, layers=stacked)
    if kv:
        cache = KVCache(k=jnp.stack(cache.k), v=jnp.stack(cache.v))
    return params, cache


def leaves_ab(repeats: int = 200) -> list[str]:
    """Median us until the null step's call returns, per params/cache pytree (Llama-3.1-8B's
    leaves as the engine holds them, then stacked over the layers), interleaved; the int input
    is 1 KB so only the leaves differ. The cache is donated and taken back, as in the engine."""
    import statistics
    import time

    from benchmarks import null_step
    from serving.step.step_executables import StepExecutables
    base = null_step.llama8b_like()
    trees = {"8b (195 + 64)": base,
             "layers stacked (9 + 64)": stacked_like(*base, layers=True, kv=False),
             "kv stacked (195 + 2)": stacked_like(*base, layers=False, kv=True),
             "both (9 + 2)": stacked_like(*base, layers=True, kv=True)}
    body = null_step._null_body
    steps = {name: StepExecutables(body, signature_of=body,  # one compiled variant each
                                   donate_argnums=(1, 5, 6, 7)) for name in trees}
    ints, floats = np.zeros(256, np.int32), np.ones(8, np.float32)
    kw = dict(t=8, s=4, all_greedy=True, use_filter=False, num_logprobs=0)
    state = {name: [params, jax.tree.map(jnp.copy, cache)] for name, (params, cache) in
             trees.items()}
    times: dict = {name: [] for name in trees}
    for i in range(repeats + 10):
        for name, st in state.items():
            t0 = time.perf_counter()
            out = steps[name](st[0], st[1], ints, floats, None, None, None, None, **kw)
            dt = time.perf_counter() - t0
            st[1] = out[0]
            jax.block_until_ready(out[1])
            if i >= 10:
                times[name].append(dt)
    return [f"{name:>24}: {1e6 * statistics.median(ts):7.1f} us" for name, ts in times.items()]


def decode_ab(rounds: int = 3, seqs: int = 32, tokens: int = 64) -> list[str]:
    """The CPU engine (tiny_llama3, real step) decoding `seqs` sequences of `tokens` tokens,
    resident tables vs [S, NB] rows, alternating `rounds` times: median ms of the step call
    (ModelRunner.last_dispatch) and of a whole step (generate's wall / steps)."""
    import statistics
    import time

    from minipic_jax import LLM, SamplingParams
    llm = LLM("tiny_llama3", dtype="float32", seed=0, max_num_seqs=seqs, max_model_len=4096,
              block_size=16, num_kv_blocks=seqs * 16 + 64, min_token_bucket=seqs)
    eng, runner = llm.llm_engine, llm.llm_engine.runner
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, 100).tolist() for _ in range(seqs)]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # compiles
    res: dict = {"rows": ([], []), "resident": ([], [])}
    dispatch, calls = runner._dispatch, []

    def timed(*args):
        t0 = time.perf_counter()
        out = dispatch(*args)
        calls.append(time.perf_counter() - t0)
        return out
    runner._dispatch = timed
    for _ in range(rounds):
        for mode, (call_ms, step_ms) in res.items():
            runner.dev_tables.set(mode == "resident")
            llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # the upload
            calls.clear()
            steps0, t0 = eng.stats.steps, time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            step_ms.append(1e3 * (time.perf_counter() - t0) / (eng.stats.steps - steps0))
            call_ms.append(1e3 * statistics.median(calls))
    runner._dispatch = dispatch
    return [f"{mode:>9}: step call {statistics.median(c):.3f} ms, step {statistics.median(s):.3f} "
            f"ms (NB {runner.nb}, {seqs} seqs)" for mode, (c, s) in res.items()]


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["leaves"]:
        print("\n".join(leaves_ab()))
    elif sys.argv[1:2] == ["decode"]:
        print("\n".join(decode_ab()))
    else:
        raise SystemExit(tables_ab())
