"""A hybrid engine's default pool and XLA memory limit count its span steps: it
warms and runs them under the step's compile options, and their temporaries are the largest of
the top bucket (tiny_qwen3_5: 2.8x a plain step's), so a pool sized from the plain steps alone
left them too little (XLA's "Can't reduce memory use below ... by rematerialization" at the
Qwen3.5-0.8B span request's warm-up on an H100: benchmarks/RESULTS.md, Known gaps)."""

import types

import jax
import jax.numpy as jnp

from configs.presets import get_preset
from serving.cache import kv_pool, xla_limit
from serving.config import Config


class _Device:
    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": 0}


def test_span_steps_set_the_reserve_and_the_exact_limit(monkeypatch):
    from minipic_jax.models import qwen3_5
    from serving.step.model_runner import ModelRunner
    limit = 256 << 20
    monkeypatch.setattr(kv_pool, "device_memory", lambda: {"bytes_limit": limit})
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_Device(limit)])
    mcfg = get_preset("tiny_qwen3_5")
    cfg = Config.from_flat(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128,
                           block_size=16, min_token_bucket=128, gpu_memory_utilization=0.5)
    params = qwen3_5.init_params(mcfg, jax.random.PRNGKey(0), jnp.float32)
    loaded = types.SimpleNamespace(cfg=mcfg, params=params, family=qwen3_5, tokenizer=None)
    runner = ModelRunner(cfg, loaded, 2, jnp.float32)
    steps = [kw for _, _, kw in runner.warmup_steps(spans=True)
             if "compose" not in kw and kw["t"] == cfg.token_buckets[-1] and not kw["decode_only"]]
    programs = runner.step_programs  # size_pool's step_temps.step_programs, in warm-up order
    assert len(programs) == len(steps) and any(kw.get("spans") for kw in steps)
    by_kind = {}
    for kw, p in zip(steps, programs):
        by_kind.setdefault(bool(kw.get("spans")), []).append(p.temp)
    assert max(by_kind[True]) > max(by_kind[False])  # the span step holds the most
    assert runner.step_reserve == max(by_kind[True])
    per_block = kv_pool.kv_bytes_per_block(runner.cache, runner.num_blocks, cfg.block_size)
    assert runner.num_blocks == int((limit * 0.5 - runner.step_reserve) // per_block)
    assert runner._step.compiler_options == xla_limit.exact_limit_options(limit, programs)
