"""LLM.update_weights: new weights served in place (no recompile), old cache entries never hit,
bad params rejected with the leaf named while the old weights keep serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from minipic_jax import SamplingParams
from minipic_jax.loading import load_model
from minipic_jax.models import nnx_pure
from minipic_jax.models.llama import _fuse_layer
from tests.conftest import REPO, make_tiny_llm

SP = SamplingParams(temperature=1.0, max_tokens=6, seed=11, logprobs=0, n=2)
PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 37, 20)]
# the engines at one token bucket (min_token_bucket = max_num_batched_tokens = 64): no test here
# is about bucket sizes, and each bucket compiled its own step variants (CI time)
ONE = dict(min_token_bucket=64)


def _run(llm):
    outs = llm.generate(PROMPTS, SP, use_tqdm=False)
    toks = [c.token_ids for o in outs for c in o.outputs]
    lps = [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for o in outs for c in o.outputs]
    return toks, lps, [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def new_params():
    return load_model("tiny_llama", dtype="float32", seed=1).params


@pytest.fixture(scope="module")
def fresh_outputs():
    return _run(make_tiny_llm(seed=1, **ONE))


def test_update_serves_new_weights_without_recompiling(new_params, fresh_outputs):
    llm = make_tiny_llm(**ONE)
    before = _run(llm)
    _run(llm)  # every step variant of these requests is ready now
    compiles, fuse_compiles = llm.llm_engine.runner.num_compiles, _fuse_layer._cache_size()
    theirs = jax.tree.map(jnp.copy, new_params)
    assert llm.update_weights(theirs) == 1
    # the engine serves its own arrays: the caller may donate or delete its params afterwards
    assert not any(x.is_deleted() for x in jax.tree.leaves(theirs))
    for x in jax.tree.leaves(theirs):
        x.delete()
    after = _run(llm)
    assert after[0] == fresh_outputs[0] and after[0] != before[0]
    np.testing.assert_allclose(np.concatenate(after[1]), np.concatenate(fresh_outputs[1]),
                               atol=1e-5)
    assert llm.llm_engine.runner.num_compiles == compiles
    assert _fuse_layer._cache_size() == fuse_compiles


def test_old_cache_entries_never_hit_after_update(new_params, tmp_path):
    llm = make_tiny_llm(kv_store_dir=str(tmp_path), **ONE)
    first = _run(llm)
    assert _run(llm)[2][1] > 0  # the 37-token prompt hits its cached blocks
    llm.llm_engine.flush_kv_store()
    keys = llm.llm_engine.cache.keys
    h0 = keys.root_hash_fn(None)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    llm.update_weights(new_params)
    assert keys.root_hash_fn(None) != h0
    assert llm.llm_engine.kv_store is None  # detached: it holds the loaded weights' blocks
    # device cache forgotten, and the span store (written under the old keys) misses too: hits
    # only within the call, as on a fresh engine's first call (the 20-token prompt shares the
    # 37-token one's first block)
    assert first[2] == [0, 0, 16]
    assert _run(llm)[2] == first[2]
    llm.update_weights(load_model("tiny_llama", dtype="float32", seed=0).params)
    back = _run(llm)
    assert back[2] == first[2] and back[0] == first[0]
    llm.llm_engine.flush_kv_store()
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == files  # nothing written


def test_bad_params_name_the_leaf_and_keep_serving(new_params):
    llm = make_tiny_llm(**ONE)
    before = _run(llm)
    wrong_shape = jax.tree.map(lambda x: x, new_params)
    wrong_shape["layers"] = (new_params["layers"][0], {**new_params["layers"][1],
                                                       "wq": jnp.zeros((64, 32))})
    with pytest.raises(ValueError, match=r"\['layers'\]\[1\]\['wq'\] has shape \(64, 32\)"):
        llm.update_weights(wrong_shape)
    with pytest.raises(ValueError, match=r"\['embed'\] has shape .* dtype bfloat16"):
        llm.update_weights({**new_params, "embed": new_params["embed"].astype(jnp.bfloat16)})
    missing = {k: v for k, v in new_params.items() if k != "final_norm"}
    with pytest.raises(ValueError, match=r"\['final_norm'\] is missing"):
        llm.update_weights(missing)
    extra = {**new_params, "bias": jnp.zeros(3)}
    with pytest.raises(ValueError, match=r"\['bias'\] is not a parameter"):
        llm.update_weights(extra)
    still = _run(llm)  # (a cache hit now: logprobs equal up to the batching's rounding)
    assert still[0] == before[0] and llm.weights_version.generation == 0
    np.testing.assert_allclose(np.concatenate(still[1]), np.concatenate(before[1]), atol=1e-5)


def test_nnx_state_and_donation(new_params, fresh_outputs):
    llm = make_tiny_llm(**ONE)
    state = nnx.State(nnx_pure.to_state_dict(jax.tree.map(jnp.copy, new_params)))
    llm.update_weights(state, donate=True)
    assert _run(llm)[0] == fresh_outputs[0]


@pytest.mark.slow  # a subprocess over 4 host devices (~16 s on CI's cores): --run-slow
def test_tensor_parallel_update_places_by_the_rules_table():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-m", "tests.tp_update_run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["changed"] and got["equal"] and got["same_place"] and got["retraces"] == 0
    assert got["err"] <= 1e-5


def _live_bytes():
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def test_update_writes_into_the_served_buffers(new_params):
    """Nothing freed or allocated but one layer's temporaries: the served weights keep their
    buffers (a best-fit device allocator never sees a hole to misfit; issue 30: +1520 MiB over
    in-use on the first llama3_8b update when layers were freed and re-allocated)."""
    llm = make_tiny_llm(**ONE)
    runner = llm.llm_engine.runner
    llm.update_weights(new_params)  # (on CPU a loaded leaf may wrap host memory: copied once)
    before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(runner.params)]
    theirs = jax.tree.map(jnp.copy, new_params)
    # every array live now held (earlier tests' uncollected ones too), so a garbage collection
    # during the update frees none of them and the byte count is this update's alone
    held = jax.live_arrays()
    live = _live_bytes()
    llm.update_weights(theirs, donate=True)  # donated: written, then deleted
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(runner.params)] == before
    assert all(x.is_deleted() for x in jax.tree.leaves(theirs))
    assert _live_bytes() == live - sum(x.nbytes for x in jax.tree.leaves(new_params))
    del held
    served = runner.family.unfuse_params(runner.params)
    for got, want in zip(jax.tree.leaves(served), jax.tree.leaves(new_params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    writer = llm.weights_version.writer
    assert writer.compiles == 2  # the top-level leaves' program and the layers' one
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.params["layers"][0]))
    for program in writer._compiled.values():
        mem = program.memory_analysis()
        # every output in place (what is not aliased: the output tuple's pointer table)
        assert mem.output_size_in_bytes - mem.alias_size_in_bytes <= 8 * 16
        assert mem.temp_size_in_bytes <= layer_bytes, (mem.temp_size_in_bytes, layer_bytes)


def test_write_programs_at_the_8b_shape_hold_no_more_than_one_layer():
    """The llama3_8b bf16 shape (issue 30's run), compiled for the host from shapes alone: every
    output written in place, temporaries within one fused layer (416 MiB)."""
    from configs.presets import get_preset
    from minipic_jax.models import llama, llama_modules
    from minipic_jax.weights_write import WeightsWriter
    cfg = get_preset("llama3_8b")

    def avals(fused):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16),
                            llama_modules.shapes(cfg, fused=fused),
                            is_leaf=lambda s: isinstance(s, tuple) and not isinstance(s[0], dict))
    served, new = avals(True), avals(False)
    layer_bytes = sum(x.size * 2 for x in jax.tree.leaves(served["layers"][0]))
    assert layer_bytes == 436_224_000  # rl_measure's "one layer: 416 MiB"
    writer = WeightsWriter(llama, fuse=True)
    top = [k for k in served if k != "layers"]
    for old, given, layer in ((served["layers"][0], new["layers"][0], True),
                              ({k: served[k] for k in top}, {k: new[k] for k in top}, False)):
        mem = writer.compile(old, given, layer=layer).memory_analysis()
        assert mem.output_size_in_bytes - mem.alias_size_in_bytes <= 8 * 16
        assert mem.temp_size_in_bytes <= layer_bytes


def test_prepared_write_programs_leave_the_update_nothing_to_compile(new_params):
    """`weights_update.prepare` (the warm-up calls it) compiles from the served params and the
    spec what the first update runs: the update then compiles nothing."""
    from minipic_jax import weights_update
    llm = make_tiny_llm(**ONE)
    assert weights_update.prepare(llm) == 2 and weights_update.prepare(llm) == 0
    llm.update_weights(new_params)
    assert llm.weights_version.writer.compiles == 2
