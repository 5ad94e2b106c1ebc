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
