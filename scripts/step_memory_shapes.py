"""What the engine's step holds besides its arguments, at a real model's shape, from shapes only
(no weights, no pool allocated): builds a ModelRunner over jax.ShapeDtypeStruct params and
cache, then for the top token bucket's general step prints
- the traced program's largest intermediates (the jaxpr, kernel calls included: a GPU's view
  when --backend gpu traces the compiled-path attention), each with the primitive that makes it;
- with --compile (host backend only): XLA's memory analysis of the step compiled for the host.

  PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/step_memory_shapes.py [--preset tulu3_block_ft]
      [--max-model-len 33792] [--max-num-seqs 64] [--max-num-batched-tokens 8192]
      [--num-kv-blocks 4096] [--backend gpu|cpu] [--compile] [--top 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np

GIB = float(1 << 30)


def abstract_runner(preset: str, max_model_len: int, max_num_seqs: int, tokens: int,
                    num_kv_blocks: int, backend: str, layers: int | None = None):
    """A ModelRunner whose params and cache are ShapeDtypeStructs (tracing / lowering only)."""
    from configs.presets import get_preset
    from minipic_jax.models import get_family, llama_modules
    from serving.config import Config
    from serving.cache import kv_pool
    from serving.step import model_runner
    mcfg = get_preset(preset)
    if layers:  # fewer layers: the same per-layer buffers, a quicker compile
        mcfg = dataclasses.replace(mcfg, num_layers=layers)
    family = get_family(mcfg.model_type)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16),
                          llama_modules.shapes(mcfg, fused=True),
                          is_leaf=lambda s: isinstance(s, tuple) and not isinstance(s[0], dict))
    cfg = Config(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=tokens, min_token_bucket=128,
                 num_kv_blocks=num_kv_blocks, fuse_weights=False)  # params come fused
    loaded = types.SimpleNamespace(cfg=mcfg, params=params, family=family, tokenizer=None)
    abstract_pool = lambda make, n, **kw: (jax.eval_shape(lambda: make(n)), n)  # noqa: E731
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(kv_pool, "allocate_pool", abstract_pool))
        stack.enter_context(_patched(jax, "block_until_ready", lambda x: x))
        if backend != jax.default_backend():
            stack.enter_context(_patched(jax, "default_backend", lambda: backend))
        runner = model_runner.ModelRunner(cfg, loaded, num_kv_blocks, jnp.bfloat16)
    return runner


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def top_step(runner):
    """(args, kw) of the top token bucket's general step with the most prefill rows."""
    top = runner.config.token_buckets[-1]
    steps = [x for x in runner.warmup_steps() if x[2]["t"] == top and not x[2]["decode_only"]]
    ints, floats, kw = steps[-1]
    args = list(runner._args(ints, floats, False, kw))
    args[2] = jax.ShapeDtypeStruct(ints.shape, jnp.int32)
    args[3] = jax.ShapeDtypeStruct(floats.shape, jnp.float32)
    return tuple(args), kw


def largest_intermediates(runner, args, kw, top: int = 12) -> list:
    """[(bytes, shape, dtype, primitive)] of the traced step's largest equation outputs
    (sub-jaxprs included, kernel bodies not), biggest first, one row per distinct
    (shape, dtype, primitive), with how many equations make it."""
    from tests.jaxpr_walk import outer_eqns  # noqa: PLC0415 - a test helper, reused here
    with _patched(jax, "default_backend", lambda: runner.backend):
        jaxpr = jax.make_jaxpr(lambda *a: runner._step_impl(*a, **kw))(*args).jaxpr
    rows: dict = {}
    for eqn in outer_eqns(jaxpr):
        for v in eqn.outvars:
            aval = v.aval
            if not hasattr(aval, "shape"):
                continue
            nbytes = int(np.prod(aval.shape)) * jnp.dtype(aval.dtype).itemsize
            key = (nbytes, tuple(aval.shape), str(aval.dtype), eqn.primitive.name)
            rows[key] = rows.get(key, 0) + 1
    return sorted(((k, n) for k, n in rows.items()), reverse=True)[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tulu3_block_ft")
    p.add_argument("--max-model-len", type=int, default=33792)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--backend", default=jax.default_backend())
    p.add_argument("--compile", action="store_true")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--layers", type=int, default=None)
    a = p.parse_args()
    runner = abstract_runner(a.preset, a.max_model_len, a.max_num_seqs,
                             a.max_num_batched_tokens, a.num_kv_blocks, a.backend, a.layers)
    runner.backend = a.backend
    args, kw = top_step(runner)
    print(f"{a.preset} max_model_len {a.max_model_len} tokens {kw['t']} seqs {kw['s']} "
          f"attention {runner.attn_impl} plan {kw['attn_options']}", flush=True)
    from serving.cache.step_temps import peak_bytes
    with _patched(jax, "default_backend", lambda: runner.backend):
        jaxpr = jax.make_jaxpr(lambda *x: runner._step_impl(*x, **kw))(*args)
    from serving.cache.step_temps import step_reserve
    with _patched(jax, "default_backend", lambda: runner.backend):
        reserve = step_reserve(runner, runner._args, runner._step_impl)
    print(f"traced peak of intermediates (serving/cache/step_temps.py): this step "
          f"{peak_bytes(jaxpr) / GIB:.2f} GiB, the pool's reserve (top bucket's variants) "
          f"{reserve / GIB:.2f} GiB", flush=True)
    for (nbytes, shape, dtype, prim), n in largest_intermediates(runner, args, kw, a.top):
        print(f"  {nbytes / GIB:8.3f} GiB  {dtype:9s} {str(shape):34s} {prim} x{n}")
    if a.compile:
        mem = runner._step.jitted.lower(*args, **kw).compile().memory_analysis()
        print(f"memory analysis: temp {mem.temp_size_in_bytes / GIB:.2f} GiB arguments "
              f"{mem.argument_size_in_bytes / GIB:.2f} GiB output "
              f"{mem.output_size_in_bytes / GIB:.2f} GiB alias {mem.alias_size_in_bytes / GIB:.2f}"
              f" GiB", flush=True)


if __name__ == "__main__":
    main()
