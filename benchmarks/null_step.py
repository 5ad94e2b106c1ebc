"""A compiled engine step that computes nothing, called exactly as the runner calls its step: the
host cost of the step call (issue 28's `step_call`: 3.3-3.5 ms on the H200's host) without the
device's work, on any backend.

`ModelRunner._dispatch` calls a `jax.stages.Compiled` (serving/step/step_executables.py) with
(params, cache, the packed int32 inputs, the float32 sampling inputs, prev tokens, pools). On the
host that call flattens the params and cache pytrees and checks every leaf (type, sharding,
placement), copies the two numpy input buffers to the device (the int buffer's [S, NB] block
tables are 99% of its 1.6 MB at 64 seats and a 33K-token max_model_len), hands over the donated
cache leaves, makes one `jax.Array` per output leaf, and launches the executable (on a GPU one
launch per kernel unless command buffers record them). `NullStep` keeps all of that but the
kernels: its body returns the cache and a zero [S, 2] output.

`shape="llama8b"`: params and cache with Llama-3.1-8B's pytree (32 layers of 6 fused weights,
embedding, final norm, LM head; K and V per layer), each leaf a small array, so the per-leaf
part of the call is the 8B model's; else the engine's own params and cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LLAMA_8B_LAYERS = 32
LAYER_WEIGHTS = ("attn_norm", "mlp_norm", "w_down", "w_gate_up", "wo", "wqkv")


def llama8b_like(dtype=jnp.bfloat16):
    """(params, cache) pytrees with Llama-3.1-8B's leaves (as the engine holds them: fused
    weights, a KVCache of per-layer K and V), each leaf [8, 8]."""
    from minipic_jax.models.llama import KVCache

    def leaf():
        return jnp.zeros((8, 8), dtype)
    params = {"embed": leaf(), "final_norm": leaf(), "lm_head": leaf(),
              "layers": tuple({k: leaf() for k in LAYER_WEIGHTS}
                              for _ in range(LLAMA_8B_LAYERS))}
    cache = KVCache(k=tuple(leaf() for _ in range(LLAMA_8B_LAYERS)),
                    v=tuple(leaf() for _ in range(LLAMA_8B_LAYERS)))
    return params, cache


def _null_body(params, cache, ints, floats, prev=None, pool=None, maps=None, tables=None, *, t, s,
               all_greedy, use_filter, num_logprobs, decode_only=False, spans=False,
               attn_options=None, compose=()):
    """The step's signature and outputs, no work: the cache back, a zero [S, C] output. The
    inputs are read (one entry each, times 0.0): an unread argument is dropped from the
    compiled program, and its host->device copy with it."""
    width = 2 + (1 + 2 * num_logprobs if num_logprobs else 0)
    read = (ints[0] + ints[-1]).astype(jnp.float32) + floats[0]
    return cache, jnp.zeros((s, width), jnp.float32) + 0.0 * read, prev, pool, maps, tables


def install(runner, shape: str = "engine"):
    """Replace `runner`'s step by the null step (with `shape="llama8b"`, its params and cache
    by Llama-3.1-8B-like ones too); returns the StepExecutables now called."""
    from serving.step.step_executables import StepExecutables
    if shape == "llama8b":
        runner.params, runner.cache = llama8b_like()
    elif shape != "engine":
        raise ValueError(f"null step shape {shape!r}: 'engine' or 'llama8b'")
    step = StepExecutables(_null_body, signature_of=_null_body, donate_argnums=(1, 5, 6, 7))
    runner._step = step
    return step


def num_leaves(runner) -> int:
    """Leaves of the params and cache the step is called with."""
    return len(jax.tree.leaves((runner.params, runner.cache)))
