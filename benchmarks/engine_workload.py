"""The engine benchmark's requests: a RAG-style workload (shared system prompt, SSEP document
spans, random questions and output lengths) and a decode batch primed as if its prompts had been
computed. Used by `minipic-bench engine`, on the GPU and in its --host-only profile."""

from __future__ import annotations


def prime_decode(engine, batch: int, ctx: int, steps: int, rng):
    """Admit `batch` requests with ctx-1 prompt tokens as if their prompts were computed."""
    from minipic_jax import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{i}", rng.integers(0, min(120000, engine.vocab_size), ctx - 1)
                           .tolist(), sp)
    sched = engine.scheduler
    while sched.waiting:
        seq = sched.waiting[0]
        if not engine.cache.admit(seq, sched.free_seats):
            raise RuntimeError("pool too small for the decode batch")
        sched.waiting.popleft()
        sched.running.append(seq)
        seq.num_computed = len(seq) - 1  # synthetic context: the next step is a decode


def rag_workload(n: int, rng, block_size: int, markers: dict, max_len: int | None = None):
    """n RAG prompts (a shared system prompt, 1-4 of 64 shared documents as spans, a question)
    and their max_tokens; with `max_len`, documents are dropped from a request (then its
    question shortened) until prompt + max_tokens fit, so any --ctx runs."""
    from minipic_jax import Prompt, Span, build_prompt
    system = rng.integers(0, 120000, 90).tolist()
    docs = [rng.integers(0, 120000, int(rng.integers(30, 250))).tolist() for _ in range(64)]
    prompts, max_tokens = [], []
    for _ in range(n):
        picked = rng.choice(len(docs), size=int(rng.integers(1, 5)), replace=False)
        q = rng.integers(0, 120000, int(rng.integers(5, 60))).tolist()
        mt = int(rng.integers(4, 48))
        segs = [Prompt(system), *[Span(docs[d]) for d in picked], Prompt(q)]
        ids = build_prompt(segs, block_size=block_size, **markers)
        while max_len is not None and len(ids) + mt > max_len:
            if len(segs) > 2:
                segs.pop(-2)
            elif len(segs[-1].content) > 1:
                segs[-1] = Prompt(segs[-1].content[:len(segs[-1].content) // 2])
            else:
                raise ValueError(f"--ctx {max_len} is too short for the workload's system prompt "
                                 f"({len(system)} tokens) + max_tokens {mt}")
            ids = build_prompt(segs, block_size=block_size, **markers)
        prompts.append(ids)
        max_tokens.append(mt)
    return prompts, max_tokens
