"""Ray Data replicas (local ray on CPU): a job over a small dataset gives what one
`LLM.generate` gives. Skipped when the optional `ray` extra is not installed. The default run
takes the routed path (one block per replica); MINIPIC_RUN_SLOW=1 (or --run-slow) adds the
unrouted map_batches path."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from minipic_jax import LLM, Prompt, SamplingParams, Span, build_prompt  # noqa: E402
from minipic_jax.distributed.ray_data import generate_dataset, prompts_dataset  # noqa: E402
from minipic_jax.distributed.routing import affinity_order, route_by_spans, span_keys  # noqa: E402

RUN_SLOW = os.environ.get("MINIPIC_RUN_SLOW") == "1" or "--run-slow" in sys.argv
# one token bucket (one compile per actor); prompts of 96 tokens run as chunked prefills. The
# actors read the suite's compilation cache, which the reference LLM (the same configuration)
# has just filled: they load its executables instead of compiling them again (two at once).
LLM_KW = dict(dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=32,
              min_token_bucket=32, max_model_len=128, block_size=16, num_kv_blocks=64,
              compilation_cache=jax.config.jax_compilation_cache_dir or False)
SAMPLING = dict(temperature=0.0, max_tokens=4, logprobs=0)


@pytest.fixture(scope="module")
def job():
    """Local ray (2 CPUs), 6 prompts over 3 shared spans, and one LLM's outputs for them."""
    rng = np.random.default_rng(0)
    print("seed 0")
    llm = LLM("tiny_llama", **LLM_KW)
    docs = [rng.integers(0, 256, 20).tolist() for _ in range(3)]
    prompts = [build_prompt([Prompt([256, 1, 2]), Span(docs[i % 3]), Span(docs[(i + 1) % 3]),
                             Prompt(rng.integers(0, 256, 4).tolist())],
                            block_size=16, **llm.llm_engine.markers) for i in range(6)]
    ref = llm.generate(prompts, SamplingParams(**SAMPLING), use_tqdm=False)
    spans = [span_keys(p, block_size=16, markers=llm.llm_engine.markers) for p in prompts]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu",
                                       "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    yield prompts, spans, ref
    ray.shutdown()


def _run_and_compare(ds, ref) -> list:
    out = generate_dataset(ds, model="tiny_llama", num_replicas=2, llm_kwargs=LLM_KW,
                           sampling=SAMPLING, batch_size=3)
    rows = sorted(out.take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(len(ref)))
    for r, o in zip(rows, ref):
        assert r["generated_token_ids"].tolist() == o.outputs[0].token_ids, r["id"]
        np.testing.assert_allclose(r["cumulative_logprob"], o.outputs[0].cumulative_logprob,
                                   rtol=0, atol=1e-5)
    return rows


def test_routed_replicas_equal_single_generate(job):
    prompts, spans, ref = job
    routes = route_by_spans(spans, 2, slack=0.5)
    assert sorted(set(routes.tolist())) == [0, 1]
    ds = prompts_dataset(prompts, replicas=routes, order=affinity_order(spans, routes))
    rows = _run_and_compare(ds, ref)
    # a replica's prompts run in one generate on one actor: the later ones hit its cache
    assert sum(int(r["num_cached_tokens"]) for r in rows) > 0


@pytest.mark.skipif(not RUN_SLOW, reason="slow: MINIPIC_RUN_SLOW=1 or --run-slow")
def test_unrouted_replicas_equal_single_generate(job):
    prompts, _, ref = job
    _run_and_compare(prompts_dataset(prompts), ref)


def test_prompts_dataset_errors(job):
    prompts = job[0]
    with pytest.raises(ValueError, match="replica routes"):
        prompts_dataset(prompts, replicas=[0])
    with pytest.raises(ValueError, match="permutation"):
        prompts_dataset(prompts, order=[0] * len(prompts))
