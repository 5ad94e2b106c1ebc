"""The KV cache is updated in place: a step's scratch memory does not grow with the pool.

The runner donates the cache to its jitted step, and every write (XLA scatter, the Pallas row
copy with aliased pages) must land in the donated buffers. A step that copied one layer's pages
would need scratch memory proportional to the pool, which is what XLA's memory analysis of the
compiled step shows here. On a GPU the same test checks the GPU defaults (Triton K/V write,
decode kernel); there the default pool fills most of the device, so a copy is an out-of-memory
error (seen on the H200 on 2026-11-30: 20.97 GiB, about one layer's pages).
"""

import jax
import numpy as np
import pytest

from minipic_jax import LLM
from serving.step import step_inputs


def _step_memory(num_kv_blocks: int, decode_only: bool, **engine_args) -> dict:
    llm = LLM("tiny_llama", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
              num_kv_blocks=num_kv_blocks, **engine_args)
    runner = llm.llm_engine.runner
    t = runner.config.token_buckets[0 if decode_only else -1]
    s = runner.config.seq_bucket(t)
    _, size = step_inputs.layout(t, s, runner.nb, block_size=runner.block_size)
    args = (runner.params, runner.cache, np.zeros(size, np.int32), np.ones(2 * s, np.float32))
    if runner.config.async_scheduling:
        args += (runner._prev(),)
    compiled = runner._step.lower(*args, t=t, s=s, all_greedy=True, use_filter=False,
                                  num_logprobs=0, decode_only=decode_only).compile()
    analysis = compiled.memory_analysis()
    leaves = jax.tree.leaves(runner.cache)
    return dict(temp=analysis.temp_size_in_bytes, alias=analysis.alias_size_in_bytes,
                cache=sum(x.nbytes for x in leaves), largest=max(x.nbytes for x in leaves))


# On CPU the defaults are the XLA paths; on a GPU they are the Pallas ones, so the XLA attention
# and the XLA write are checked there too.
IMPLS = [{}] + ([{"attn_impl": "xla"}, {"write_kv_impl": "xla"}]
                if jax.default_backend() == "gpu" else [])


@pytest.mark.parametrize("impls", IMPLS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items())
                         or "defaults")
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode_only"])
def test_step_scratch_memory_does_not_grow_with_the_pool(decode_only, impls):
    small = _step_memory(64, decode_only, **impls)
    large = _step_memory(1024, decode_only, **impls)
    assert large["cache"] == 16 * small["cache"]
    assert large["alias"] >= large["cache"], "the donated cache is not aliased to the output"
    growth = large["temp"] - small["temp"]
    assert growth < 0.05 * large["cache"], (
        f"scratch grew by {growth / 1e6:.1f} MB when the pool grew 16x (cache "
        f"{large['cache'] / 1e6:.1f} MB, largest array {large['largest'] / 1e6:.1f} MB): the "
        f"step copies cache pages")


def _failing_above(limit, family):
    """init_cache that fails as the GPU allocator does (RESOURCE_EXHAUSTED) above `limit`."""
    real = family.init_cache

    def init_cache(cfg, num_pages, *args, **kwargs):
        if num_pages > limit:
            raise jax.errors.JaxRuntimeError(
                f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {num_pages} pages")
        return real(cfg, num_pages, *args, **kwargs)
    return init_cache


def test_default_pool_shrinks_until_it_fits(monkeypatch):
    """A default-sized pool that the device cannot allocate (fragmented free memory on the H200)
    shrinks by 10% steps until it fits, and the engine serves with it; an explicit
    num_kv_blocks that does not fit is a ValueError naming it."""
    from minipic_jax.models import llama
    from minipic_jax import SamplingParams
    monkeypatch.setattr(llama, "init_cache", _failing_above(40, llama))
    # one 16-token bucket (min_token_bucket) for the smoke generate: one compile, not two (CI
    # time); the pool's size does not depend on it
    llm = LLM("tiny_llama", max_num_seqs=4, max_model_len=256, min_token_bucket=16)
    engine = llm.llm_engine
    assert 36 <= engine.num_blocks <= 40, engine.num_blocks  # 64 -> 57 -> 51 -> 45 -> 40
    assert engine.runner.num_blocks == engine.bm.num_blocks == engine.num_blocks
    assert jax.tree.leaves(engine.runner.cache)[0].shape[0] == engine.num_blocks
    out = llm.generate(["a b c d"] * 2, SamplingParams(max_tokens=3), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    with pytest.raises(ValueError, match="KV pool of 500 blocks does not fit"):
        LLM("tiny_llama", max_num_seqs=4, max_model_len=256, num_kv_blocks=500)
