"""The engine's host path with the device step stubbed out: `StubStep` stands in for the
runner's jitted step (the route and hybrid-cache benchmarks replay workloads with it), and
`run_host_only` is `minipic-bench engine --host-only`: the R-request RAG run and pure decode
steps timed on the host alone, on any backend."""

from __future__ import annotations

import time

from benchmarks.engine_workload import prime_decode, rag_workload


class StubStep:
    """Stands in for the runner's jitted step: returns the cache and a packed [S, C] output with
    random token ids, so the host path runs exactly as in a real step without device work."""

    def __init__(self, vocab: int, seed: int = 0):
        import numpy as np
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def __call__(self, params, cache, ints, floats, prev=None, pool=None, maps=None, tables=None,
                 *, t, s,
                 num_logprobs=0, **_):
        import numpy as np
        out = np.zeros((s, 2 + (1 + 2 * num_logprobs if num_logprobs else 0)), np.float32)
        out[:, 0] = self.rng.integers(0, self.vocab, s)
        return cache, out, prev, pool, maps, tables

    def _cache_size(self) -> int:
        return 0


def run_host_only(args) -> int:
    """The R-request RAG run with the device step stubbed (host time only, any backend)."""
    import cProfile
    import pstats

    import numpy as np

    from minipic_jax import LLM, SamplingParams
    bs = 16
    llm = LLM(args.model, dtype="float32", seed=0, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.ctx + 64,
              block_size=bs, num_kv_blocks=args.batch * (-(-(args.ctx + 64) // bs)) + 64,
              min_token_bucket=args.min_token_bucket, attn_impl=args.attn_impl,
              async_scheduling=not args.no_async, tensor_parallel_size=args.tensor_parallel_size)
    engine = llm.llm_engine
    engine.runner._step = StubStep(engine.vocab_size)
    rng = np.random.default_rng(0)
    prompts, max_tokens = rag_workload(args.num_requests, rng, bs, engine.markers,
                                       max_len=llm.config.max_model_len)
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    for i, (ids, sp) in enumerate(zip(prompts, sps)):
        engine.add_request(str(i), ids, sp)
    prof = cProfile.Profile() if args.profile else None
    outs = []
    t, cpu0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    while engine.has_unfinished():
        outs += engine.step()
    if prof:
        prof.disable()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu0
    st = engine.get_stats()
    ms = st["host_ms_per_step"]
    print(f"host-only: {len(outs)} requests, {st['steps']} steps in {elapsed:.2f} s; per step (ms): "
          f"schedule {ms['schedule']:.3f} build {ms['build']:.3f} post {ms['post']:.3f} "
          f"dispatch(stub) {ms['dispatch']:.3f} overlapped {ms.get('overlap', 0.0):.3f}; host work "
          f"{ms['schedule'] + ms['build'] + ms['post']:.3f} ms/step; "
          f"cached {sum(o.num_cached_tokens for o in outs)} prompt tokens; process CPU "
          f"{1e3 * cpu / max(st['steps'], 1):.3f} ms/step")
    # pure decode steps at batch B, context C (as in the GPU decode measurement)
    prime_decode(engine, args.batch, args.ctx, args.decode_steps, rng)
    engine.step()
    h = engine.stats
    h0, n0 = h.schedule + h.build + h.post, h.steps
    for _ in range(args.decode_steps):
        engine.step()
    print(f"host-only decode steps (batch {args.batch}, ctx {args.ctx}): host work "
          f"{1e3 * (h.schedule + h.build + h.post - h0) / (h.steps - n0):.3f} ms/step")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0
