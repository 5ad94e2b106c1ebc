"""Subprocess half of tests/test_tensor_parallel.py (not a test module: it needs
XLA_FLAGS=--xla_force_host_platform_device_count set before JAX starts, which the test does).

    python -m tests.tp_runs FIXTURE TP[,TP...] [--errors] [--checkpoints]   -> one JSON line

For each tensor_parallel_size: greedy generation with logprobs over the fixture's HF prompts
and a few structured prompts that repeat SSEP spans (prefix-cache hits, position-free KV);
plus the parameter / KV-pool shardings and the collectives in the compiled step.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np

from minipic_jax import LLM, Prompt, SamplingParams, Span, build_prompt
from tests.conftest import FIXTURES

MAX_TOKENS = 6


def _prompts(llm, ref) -> list:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, 20).tolist() for _ in range(2)]
    structured = [build_prompt([Prompt([1, 2, 3]), Span(docs[i % 2]), Span(docs[(i + 1) % 2]),
                                Prompt(rng.integers(0, 250, 3).tolist())], block_size=16,
                               **llm.llm_engine.markers) for i in range(3)]
    hf = [ref[k].tolist() for k in sorted(ref.files) if k.startswith("prompt_")]
    return hf, structured


def run(name: str, tp: int) -> dict:
    ref = np.load(FIXTURES / name / "reference.npz")
    llm = LLM(str(FIXTURES / name), dtype="float32", seed=0, max_num_seqs=4,
              max_num_batched_tokens=32, min_token_bucket=32, max_model_len=192, block_size=16,
              num_kv_blocks=64, tensor_parallel_size=tp)
    hf, structured = _prompts(llm, ref)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    outs = llm.generate(hf + structured, sp, use_tqdm=False)
    runner = llm.llm_engine.runner
    hlo = ""
    if tp > 1:  # the last step, compiled again for its text (TP=1 has no collectives)
        ints, floats, kw = runner.last_inputs
        args = (runner.params, runner.cache, ints, floats) + (
            (runner._prev(),) if llm.config.async_scheduling else ())
        hlo = runner._step.lower(*args, **kw).compile().as_text()
    kv = runner.cache.k[0]
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                     for o in outs],
        "hf_greedy": [ref[f"greedy_{i}"].tolist()[:MAX_TOKENS] for i in range(len(hf))],
        "cached": [o.num_cached_tokens for o in outs[len(hf):]],
        "kv_spec": [str(a) for a in kv.sharding.spec] if tp > 1 else [],
        "kv_shard_shape": list(kv.sharding.shard_shape(kv.shape)),
        "kv_shape": list(kv.shape),
        "all_reduces": len(re.findall(r" all-reduce\(", hlo)),
        "all_gather_shapes": re.findall(r"= (\S+) all-gather\(", hlo),
    }


def checkpoints(name: str, tp: int) -> dict:
    """A hybrid's recurrent checkpoints (forward_with_checkpoints at chunk-aligned positions of
    the fixture's 150-token prompt) and final states, placed as the engine places them."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from minipic_jax.loading import load_model
    from minipic_jax.models import testing
    from serving import sharding
    lm = load_model(str(FIXTURES / name))
    prompt = np.load(FIXTURES / name / "reference.npz")["prompt_2"].astype(np.int32)
    pager = testing.SimplePager(1, len(prompt) + 8, 16, seed=1)
    cfg, mesh = lm.cfg, None
    if tp > 1:  # as the engine places them
        mesh, cfg = sharding.place_model(lm, tp)
    params = lm.params

    def make():
        return lm.family.init_cache(cfg, pager.num_pages, 16, 1, jnp.float32)
    cache = make() if mesh is None else sharding.init_sharded(make, lm.family.cache_axes(cfg),
                                                              mesh)
    md, _, total = pager.step([len(prompt)])
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:total] = prompt

    def fwd(params, tokens, md, cache, ck):
        ctx = (contextlib.nullcontext() if mesh is None
               else jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        with ctx:
            return lm.family.forward_with_checkpoints(params, tokens, md, cache, cfg,
                                                      checkpoint_at=ck)
    _, cache, cks = jax.jit(fwd)(params, jnp.asarray(tokens), md, cache,
                                 jnp.asarray([[64, 128]], jnp.int32))
    return {"ck_delta": np.asarray(cks["delta"]).tolist(),
            "ck_conv": np.asarray(cks["conv"]).tolist(),
            "final_delta": np.stack([np.asarray(d[0]) for d in cache.delta]).tolist()}


def errors(name: str) -> list[str]:
    """The ValueError of each size the fixture cannot be split over (3 heads; 8 > 4 devices)."""
    out = []
    for tp in (3, 8):
        try:
            LLM(str(FIXTURES / name), num_kv_blocks=8, max_model_len=64, tensor_parallel_size=tp)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


if __name__ == "__main__":
    fixture, sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    result = {tp: run(fixture, tp) for tp in sizes}
    if "--errors" in sys.argv:
        result["errors"] = errors(fixture)
    if "--checkpoints" in sys.argv:
        result["checkpoints"] = {tp: checkpoints(fixture, tp) for tp in sizes}
    print(json.dumps(result))
