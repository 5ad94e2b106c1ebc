"""CPU start-up probe: the engine's load and warm-up for a tiny-width Llama-3 with the real
layer count (tracing and lowering scale with layers and ops, not width), in this process.

    JAX_PLATFORMS=cpu python -m benchmarks.startup_probe --cache /tmp/jcc   # twice: cold, then warm

Prints one JSON line: import, weights (drawn), engine construction and warm-up seconds, plus the
runner's start-up split (benchmarks/startup.py) when the engine has one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

T_START = time.perf_counter()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True,
                   help="compilation cache folder (the step store is under it)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--kv-mode", default="position_free")
    args = p.parse_args()
    import jax
    import jax.numpy as jnp

    from configs.presets import get_preset
    from minipic_jax import compile_cache
    from minipic_jax.loading.loader import LoadedModel, get_family, load_tokenizer
    from serving.config import Config
    from serving.llm_engine import LLMEngine
    t_import = time.perf_counter() - T_START
    compile_cache.configure(args.cache)
    cfg = dataclasses.replace(get_preset("tiny_llama3"), num_layers=args.layers)
    t0 = time.perf_counter()
    family = get_family(cfg.model_type)
    params = jax.block_until_ready(family.init_params(cfg, jax.random.key(0), jnp.float32))
    t_weights = time.perf_counter() - t0
    loaded = LoadedModel(cfg, params, family, load_tokenizer(None, cfg), "preset:probe")
    conf = Config(max_num_seqs=16, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=1024, min_token_bucket=32, num_kv_blocks=256,
                  kv_mode=args.kv_mode)
    t0 = time.perf_counter()
    engine = LLMEngine(loaded, conf, dtype=jnp.float32)
    t_engine = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warmup()
    t_warm = time.perf_counter() - t0
    split = getattr(engine.runner, "startup", {})
    print(json.dumps({"layers": args.layers, "import_s": round(t_import, 2),
                      "weights_s": round(t_weights, 2), "engine_s": round(t_engine, 2),
                      "warmup_s": round(t_warm, 2), "variants": engine.runner.num_compiles,
                      "split": {k: round(v, 2) if isinstance(v, float) else v
                                for k, v in split.items()}}))


if __name__ == "__main__":
    main()
