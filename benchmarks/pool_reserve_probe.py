"""Issue 28: does the default KV pool leave XLA the memory the step needs? Starts the rag `ttft`
engine (fcfs config, position_free, spans warm-up) at a given max_model_len with the default pool,
warms it up (XLA's rematerialisation warnings, if any, go to stderr), then prints one JSON line:
the device's memory figures, the pool (blocks, GiB), the reserve it left the step
(ModelRunner.step_reserve, serving/cache/step_temps.py), the weights, and each compiled step
variant's memory analysis (temp / argument / output / alias GiB) with its token bucket and plan.

  PYTHONPATH=. python -m benchmarks.pool_reserve_probe [--max-model-len 40960]
      [--model tulu3_block_ft] [--num-kv-blocks N]
"""

from __future__ import annotations

import argparse
import json
import types

GIB = float(1 << 30)


def variant_memory(runner) -> list:
    """[{key, temp_gib, argument_gib, output_gib, alias_gib}] of every compiled step variant."""
    rows = []
    for key, exe in runner._step._table.items():  # noqa: SLF001 - a probe reads the table
        try:
            mem = exe.memory_analysis()
        except Exception as e:  # noqa: BLE001 - a loaded executable may not report it
            rows.append({"key": repr(key)[:160], "error": str(e)[:120]})
            continue
        rows.append({"key": repr(key[0])[:200],
                     **{f"{k}_gib": round(getattr(mem, f"{k}_size_in_bytes") / GIB, 3)
                        for k in ("temp", "argument", "output", "alias")}})
    return sorted(rows, key=lambda r: -r.get("temp_gib", 0))


def main() -> None:
    import jax
    from benchmarks.rag_engine import CONFIGS, build_engine
    from serving.cache.kv_pool import device_memory, kv_bytes_per_block
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tulu3_block_ft")
    p.add_argument("--max-model-len", type=int, default=40960)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    a = p.parse_args()
    opts = types.SimpleNamespace(model=a.model, dtype="bfloat16", max_num_seqs=64,
                                 max_num_batched_tokens=8192, min_token_bucket=128,
                                 num_kv_blocks=a.num_kv_blocks, attn_impl=None)
    before = device_memory()
    llm, timing = build_engine(opts, CONFIGS["fcfs"][0], a.max_model_len, spans=True)
    runner = llm.llm_engine.runner
    per_block = kv_bytes_per_block(runner.cache, runner.num_blocks, runner.block_size)
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    print(json.dumps({
        "max_model_len": a.max_model_len, "device_before": before, "device_after": device_memory(),
        "num_blocks": runner.num_blocks, "pool_gib": round(runner.num_blocks * per_block / GIB, 2),
        "step_reserve_gib": round(getattr(runner, "step_reserve", 0) / GIB, 2),
        "weights_gib": round(weights / GIB, 2), "warmup_s": round(timing["warmup_s"], 1),
        "pool_s": round(runner.startup.get("pool_s", 0.0), 2),
        "variants": variant_memory(runner)}), flush=True)


if __name__ == "__main__":
    main()
