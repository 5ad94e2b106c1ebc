"""Sizing the default KV pool: a block costs what the family's cache actually allocates per page."""

import jax
import jax.numpy as jnp
import pytest

from configs.presets import get_preset
from minipic_jax.models import get_family
from serving.cache import kv_pool
from serving.config import Config


class _Device:
    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": 0}


def _tiny_runner(monkeypatch, utilization: float, limit: int = 64 << 20, **config):
    """A tiny_llama ModelRunner (bf16, 4 seats, 128-token steps) whose default pool is sized
    against a 64 MiB device memory limit: (model config, Config, runner, limit)."""
    import types
    from minipic_jax.models import llama
    from serving.step.model_runner import ModelRunner
    mcfg = get_preset("tiny_llama")
    cfg = Config.from_flat(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=128,
                           block_size=16, min_token_bucket=128,
                           gpu_memory_utilization=utilization, **config)
    params = llama.init_params(mcfg, jax.random.PRNGKey(0), jnp.bfloat16)
    loaded = types.SimpleNamespace(cfg=mcfg, params=params, family=llama, tokenizer=None)
    monkeypatch.setattr(kv_pool, "device_memory", lambda: {"bytes_limit": limit})
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_Device(limit)])
    # the engine passes an explicit pool's size; 2 is the default pool's first trace
    blocks = cfg.num_kv_blocks or 2
    return mcfg, cfg, ModelRunner(cfg, loaded, blocks, jnp.bfloat16), limit


@pytest.mark.parametrize("preset", ["tiny_qwen3_5", "tiny_llama"])
def test_default_num_blocks_counts_only_paged_layers(monkeypatch, preset):
    """The oracle is the cache itself: bytes of the page-shaped leaves of a 2-page cache of the
    family (a hybrid model's recurrent layers hold per-seat states, no pages)."""
    mcfg = get_preset(preset)
    family = get_family(mcfg.model_type)
    cfg = Config(max_num_seqs=2, max_model_len=256, block_size=16, gpu_memory_utilization=0.5)
    probe = family.init_cache(mcfg, 2, cfg.block_size, 1, jnp.bfloat16)
    per_block = kv_pool.kv_bytes_per_block(probe, 2, cfg.block_size)
    limit = 1 << 30
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_Device(limit)])
    got = kv_pool.default_num_blocks(cfg, mcfg, jnp.bfloat16)
    assert got == int(limit * 0.5 // per_block)
    if preset == "tiny_qwen3_5":  # 1 of 4 layers is attention: 4x the blocks of counting all
        assert mcfg.num_kv_layers == 1 and got >= 4 * int(limit * 0.5 // (4 * per_block))


def test_default_pool_leaves_the_traced_step_its_temporaries(monkeypatch):
    """With a memory limit, the default pool is the limit's share less the weights in use less
    the step's traced temporaries (the top bucket's largest peak), no blanket cut: at the
    tulu3 shape the overflow variant's gather of every seat's table (~26 GiB at max_model_len
    33,792) went unreserved and XLA warned it could not rematerialise."""
    from serving.cache import step_temps
    mcfg, cfg, runner, limit = _tiny_runner(monkeypatch, 0.5)
    per_block = kv_pool.kv_bytes_per_block(runner.cache, runner.num_blocks, cfg.block_size)
    # the reserve is the traced peak of the top bucket's steps: at least its logits [S, vocab]
    assert runner.step_reserve == step_temps.step_reserve(runner, runner._args, runner._step_impl)
    assert runner.step_reserve >= cfg.seq_bucket(128) * mcfg.vocab_size * 4
    assert runner.num_blocks == int((limit * 0.5 - runner.step_reserve) // per_block)


def test_xla_limit_cap_keeps_every_step_program_under_the_limit(monkeypatch):
    """Issue 28, kv_pool.CAP_BY_XLA_LIMIT (off by default, see there): XLA's rematerialisation
    holds each step program to slop% of (bytes_limit - arguments - outputs + aliased) plus the
    aliased bytes, against its temporaries, weights and outputs (serving/cache/xla_limit.py).
    With the cap, the default pool leaves every top-bucket program under that limit when
    traced again with the pool as allocated, and one block more does not; the share rule alone
    (all of 64 MiB less the reserve) takes more blocks than fit."""
    from serving.cache import step_temps, xla_limit
    monkeypatch.setattr(kv_pool, "CAP_BY_XLA_LIMIT", True)
    mcfg, cfg, runner, limit = _tiny_runner(monkeypatch, 1.0)
    share = int((limit * 1.0 - runner.step_reserve) // kv_pool.block_bytes(cfg, mcfg,
                                                                           jnp.bfloat16))
    assert runner.num_blocks < share  # XLA's limit binds here, not the share
    programs = step_temps.step_programs(runner, runner._args, runner._step_impl,
                                        runner._step.donate_argnums)
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.cache))
    assert programs and all(p.alias >= pool_bytes for p in programs)  # the donated pool
    assert all(xla_limit.fits(limit, p) for p in programs)
    # the largest such pool: one block more and some program no longer fits
    more = [xla_limit.ProgramBytes(p.temp, *(x + kv_pool.block_bytes(cfg, mcfg, jnp.bfloat16)
                                             for x in (p.argument, p.output, p.alias)))
            for p in programs]
    assert not all(xla_limit.fits(limit, p) for p in more)


def test_exact_xla_limit_is_set_from_the_steps_at_the_allocated_pool(monkeypatch):
    """Config.compilation.xla_memory_limit "exact" (issue 28): the default pool is sized as
    before, and the step's compiles get XLA's slop factor that holds every top-bucket program
    traced with the pool as allocated to temporaries within 95% of the room its buffers leave
    (xla_limit.exact_limit_options; the default since session 20); XLA's rule passes no factor. Options cannot
    change once a variant is compiled."""
    from serving.cache import step_temps, xla_limit
    _, _, plain, _ = _tiny_runner(monkeypatch, 0.5, xla_memory_limit="xla")
    assert "xla_gpu_memory_limit_slop_factor" not in plain._step.compiler_options
    _, _, runner, limit = _tiny_runner(monkeypatch, 0.5, xla_memory_limit="exact")
    assert runner.num_blocks == plain.num_blocks
    programs = step_temps.step_programs(runner, runner._args, runner._step_impl,
                                        runner._step.donate_argnums)
    want = xla_limit.exact_limit_options(limit, programs)
    assert want and runner._step.compiler_options == want
    runner.warmup()  # compiles (XLA:CPU takes the GPU option by name and ignores it)
    with pytest.raises(ValueError, match="after step variants were compiled"):
        runner._step.add_compiler_options({"xla_gpu_memory_limit_slop_factor": 100})


def test_xla_memory_limit_setting_is_checked():
    with pytest.raises(ValueError, match=r"xla_memory_limit \(Config.compilation.xla_memory_limit\)"):
        Config.from_flat(xla_memory_limit="loose")


def test_exact_xla_limit_covers_an_explicit_pool(monkeypatch):
    """An explicit num_kv_blocks keeps its size and still gets the exact factor (its steps
    traced with that pool); with XLA's rule an explicit pool traces nothing."""
    from serving.cache import step_temps, xla_limit
    _, _, plain, _ = _tiny_runner(monkeypatch, 0.5, num_kv_blocks=40, xla_memory_limit="xla")
    assert plain.num_blocks == 40 and not plain._step.compiler_options
    assert not hasattr(plain, "step_programs")
    _, _, runner, limit = _tiny_runner(monkeypatch, 0.5, num_kv_blocks=40, xla_memory_limit="exact")
    assert runner.num_blocks == 40
    programs = step_temps.step_programs(runner, runner._args, runner._step_impl,
                                        runner._step.donate_argnums)
    want = xla_limit.exact_limit_options(limit, programs)
    assert want and runner._step.compiler_options == want


def test_a_default_pool_short_of_one_sequence_is_an_error_at_start(monkeypatch):
    """A default pool that cannot hold one max_model_len sequence (here a 1 MiB limit's half less
    the step's 0.55 MiB of temporaries) is a ValueError at start naming its figures, not a
    2-block engine whose requests fail one by one (what a GPU engine did in s31, with the pool's
    flat view counted as a copy); an explicit num_kv_blocks is the user's to choose."""
    with pytest.raises(ValueError, match=r"default KV pool came to \d+ blocks .* fewer than the "
                       r"16 one sequence of max_model_len 256 needs: device memory limit 0\.00 "
                       r"GiB x gpu_memory_utilization 0\.5, .*set num_kv_blocks"):
        _tiny_runner(monkeypatch, 0.5, limit=1 << 20)
    _, cfg, runner, _ = _tiny_runner(monkeypatch, 0.5, limit=1 << 20, num_kv_blocks=4)
    assert runner.num_blocks == 4
    _, cfg, runner, _ = _tiny_runner(monkeypatch, 0.5)
    assert runner.num_blocks >= cfg.max_blocks_per_seq


def test_span_steps_set_the_reserve_and_the_exact_limit(monkeypatch):
    """A hybrid engine's default pool and XLA memory limit count its span steps: it warms and
    runs them under the step's compile options, and their temporaries are the largest of the top
    bucket (tiny_qwen3_5: 2.8x a plain step's), so a pool sized from the plain steps alone left
    them too little (XLA's "Can't reduce memory use below ... by rematerialization" at the
    Qwen3.5-0.8B span request's warm-up on an H100: benchmarks/RESULTS.md, Known gaps)."""
    import types

    from minipic_jax.models import qwen3_5
    from serving.cache import xla_limit
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
