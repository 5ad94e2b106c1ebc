"""What the engine's compiled step holds on a GPU, counted in its trace on this CPU-only machine
(kernel bodies not entered): the cached-span step (one sequence of a few dozen query rows over a
long cached context, planned on the host) runs per layer the K/V write, the live gather and the
Mosaic prefill kernel, with no conditional, no while loop and no decode kernel; a step that
holds a decode row adds the decode kernel."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np

from configs.presets import PRESETS
from jaxpr_walk import KERNELS, primitive_counts
from minipic_jax.models import llama
from serving.config import Config
from serving.step.model_runner import ModelRunner
from serving.step.step_inputs import layout

LAYERS = 3
def test_cached_span_step_has_three_kernels_per_layer_and_no_control_flow(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the compiled path (traced only)
    mcfg = dataclasses.replace(PRESETS["tulu3_block_ft"], vocab_size=512, hidden_size=64,
                               intermediate_size=128, num_layers=LAYERS, num_heads=4,
                               num_kv_heads=1)
    cfg = Config(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=2048,
                 min_token_bucket=128, num_kv_blocks=16)
    params = llama.init_params(mcfg, jax.random.PRNGKey(0), jnp.bfloat16)
    loaded = types.SimpleNamespace(cfg=mcfg, params=params, family=llama, tokenizer=None)
    runner = ModelRunner(cfg, loaded, 16, jnp.bfloat16)
    assert runner.attn_impl == "mixed"
    plans = {(kw["t"], kw["attn_options"].decode_rows) for _, _, kw in runner.warmup_steps()
             if kw["attn_options"] is not None}
    # warm-up readies the decode-free variant of the small buckets only (plan_step)
    assert plans == {(128, True), (128, False), (256, True), (256, False), (512, True),
                     (512, False), (1024, True)}
    t, s = 128, cfg.seq_bucket(128)
    ints = np.zeros(layout(t, s, runner.nb, block_size=runner.block_size)[1], np.int32)
    floats = np.ones(2 * s, np.float32)

    def counts(decode_count):
        plan = runner._plan(t, s, 1, decode_count)
        step = lambda *a: runner._step_impl(*a, t=t, s=s, all_greedy=True, use_filter=False,  # noqa
                                            num_logprobs=0, attn_options=plan)
        jaxpr = jax.make_jaxpr(step)(runner.params, runner.cache, ints, floats).jaxpr
        return primitive_counts(jaxpr)

    cached, mixed = counts(0), counts(1)
    for c in (cached, mixed):
        assert not {"cond", "while"} & set(c), sorted(c)
    kernels = lambda c: sum(c[k] for k in KERNELS)  # noqa: E731
    assert kernels(cached) == 3 * LAYERS, cached  # K/V write, live gather, Mosaic prefill
    assert kernels(mixed) == 4 * LAYERS, mixed  # + the decode kernel
