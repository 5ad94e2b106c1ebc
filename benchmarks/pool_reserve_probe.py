"""Issue 28: does the default KV pool leave XLA the memory the step needs? Starts the rag `ttft`
engine (fcfs config, position_free, spans warm-up) at a given max_model_len with the default pool,
warms it up (XLA's rematerialisation warnings, if any, go to stderr), then prints one JSON line:
the device's memory figures, the pool (blocks, GiB; `xla_blocks`: what kv_pool's XLA-limit
cap, xla_limit.py, would allow), the reserve it left the step
(ModelRunner.step_reserve, serving/cache/step_temps.py), the weights, and each compiled step
variant's memory analysis (temp / argument / output / alias GiB) with its token bucket and plan,
next to XLA's limit for it by serving/cache/xla_limit.py (`limit_gib`, `limit_bytes`: the figure
XLA's warning prints) and what XLA's rematerialisation compares with it (`peak_gib`: temp +
the arguments not aliased + every output; `fits`; temp is XLA's after its rematerialisation, so
a variant XLA had to cut shows as just fitting), and the same for
the traced programs the pool was sized by (`traced`, at the pool's size). `--xla-rule` turns
the cap on (kv_pool.CAP_BY_XLA_LIMIT, off by default: the A/B).

  PYTHONPATH=. python -m benchmarks.pool_reserve_probe [--max-model-len 40960]
      [--model tulu3_block_ft] [--num-kv-blocks N] [--xla-rule]
"""

from __future__ import annotations

import argparse
import json
import types

GIB = float(1 << 30)


def limit_row(limit: int, prog) -> dict:
    """XLA's limit for `prog` (xla_limit.ProgramBytes) and what its rematerialisation compares."""
    from serving.cache import xla_limit
    return {"limit_gib": round(xla_limit.xla_limit(limit, prog) / GIB, 3),
            "limit_bytes": xla_limit.xla_limit(limit, prog),
            "peak_gib": round(xla_limit.remat_peak(prog) / GIB, 3),
            "fits": xla_limit.fits(limit, prog)}


def traced_rows(runner, limit: int, per_block: int) -> list:
    """The traced programs the default pool was sized by, moved to the pool's actual size."""
    from serving.cache.xla_limit import with_pool_bytes
    extra = (runner.num_blocks - getattr(runner, "traced_blocks", 0)) * per_block
    rows = []
    for p in getattr(runner, "step_programs", ()):
        moved = with_pool_bytes(p, extra)
        rows.append({**{f"{k}_gib": round(getattr(moved, k) / GIB, 3)
                        for k in ("temp", "argument", "output", "alias")},
                     **limit_row(limit, moved)})
    return rows


def xla_blocks(runner, limit: int, per_block: int):
    """The most blocks kv_pool's XLA-limit cap allows (None without traced programs)."""
    from serving.cache.xla_limit import blocks_within_limit
    progs = getattr(runner, "step_programs", ())
    if not (limit and progs):
        return None
    return min(blocks_within_limit(limit, p, runner.traced_blocks, per_block) for p in progs)


def variant_memory(runner, limit: int) -> list:
    """[{key, temp_gib, argument_gib, output_gib, alias_gib, limit_gib, limit_bytes, peak_gib,
    fits}] of every compiled step variant."""
    from serving.cache.xla_limit import ProgramBytes
    rows = []
    for key, exe in runner._step._table.items():  # noqa: SLF001 - a probe reads the table
        try:
            mem = exe.memory_analysis()
        except Exception as e:  # noqa: BLE001 - a loaded executable may not report it
            rows.append({"key": repr(key)[:160], "error": str(e)[:120]})
            continue
        prog = ProgramBytes(*(getattr(mem, f"{k}_size_in_bytes")
                              for k in ("temp", "argument", "output", "alias")))
        rows.append({"key": repr(key[0])[:200],
                     **{f"{k}_gib": round(getattr(prog, k) / GIB, 3)
                        for k in ("temp", "argument", "output", "alias")},
                     **(limit_row(limit, prog) if limit else {})})
    return sorted(rows, key=lambda r: -r.get("temp_gib", 0))


def main() -> None:
    import jax
    from benchmarks.rag_engine import CONFIGS, build_engine
    from serving.cache.kv_pool import device_memory, kv_bytes_per_block
    from serving.config_groups import XLA_MEMORY_LIMITS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tulu3_block_ft")
    p.add_argument("--max-model-len", type=int, default=40960)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--xla-rule", action="store_true",
                   help="cap the default pool by XLA's limit (kv_pool.CAP_BY_XLA_LIMIT)")
    p.add_argument("--xla-memory-limit", choices=XLA_MEMORY_LIMITS, default="xla",
                   help="Config.compilation.xla_memory_limit: XLA's rule or the exact factor")
    a = p.parse_args()
    from serving.cache import kv_pool
    kv_pool.CAP_BY_XLA_LIMIT = a.xla_rule
    opts = types.SimpleNamespace(model=a.model, dtype="bfloat16", max_num_seqs=64,
                                 max_num_batched_tokens=8192, min_token_bucket=128,
                                 num_kv_blocks=a.num_kv_blocks, attn_impl=None)
    before = device_memory()
    llm, timing = build_engine(opts, {**CONFIGS["fcfs"][0], "xla_memory_limit": a.xla_memory_limit},
                               a.max_model_len, spans=True)
    runner = llm.llm_engine.runner
    per_block = kv_bytes_per_block(runner.cache, runner.num_blocks, runner.block_size)
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    limit = device_memory().get("bytes_limit", 0)
    print(json.dumps({
        "max_model_len": a.max_model_len, "device_before": before, "device_after": device_memory(),
        "num_blocks": runner.num_blocks, "pool_gib": round(runner.num_blocks * per_block / GIB, 2),
        "xla_blocks": xla_blocks(runner, limit, per_block), "xla_rule": a.xla_rule,
        "xla_memory_limit": a.xla_memory_limit,
        "compiler_options": runner._step.compiler_options,
        "step_reserve_gib": round(getattr(runner, "step_reserve", 0) / GIB, 2),
        "weights_gib": round(weights / GIB, 2), "warmup_s": round(timing["warmup_s"], 1),
        "pool_s": round(runner.startup.get("pool_s", 0.0), 2),
        "traced": traced_rows(runner, limit, per_block) if limit else [],
        "variants": variant_memory(runner, limit)}), flush=True)


if __name__ == "__main__":
    main()
