"""The engine Config's option groups (serving/config_groups.py): flat vLLM keywords and grouped
objects give equal configs; unknown keywords are TypeErrors naming them; host-only fields (field
metadata) stay out of the step's compile key and every other field is in it; the engine never
changes the caller's Config; former environment variables are fields."""

from __future__ import annotations

import copy
import dataclasses

import jax.numpy as jnp
import pytest

from serving.config import Config
from serving.config_groups import (HybridCacheConfig, KVStoreConfig, SpanMapConfig,
                                   step_key_fields)

FLAT = dict(kv_store_dir="/tmp/store", kv_store_gb=8.0, kv_store_spans_only=True,
            kv_store_staging_gb=2.0, kv_store_pinned=True, checkpoint_strategy="last",
            checkpoint_step_tokens=512.0, checkpoints_per_prompt=3, checkpoint_gb=0.25,
            checkpoint_half_life=64.0, checkpoint_bucket_fit=True, span_map_gb=0.5,
            span_map_host_gb=1.0)
GROUPED = dict(kv_store=KVStoreConfig(dir="/tmp/store", gb=8.0, spans_only=True, staging_gb=2.0,
                                      pinned=True),
               hybrid_cache=HybridCacheConfig(strategy="last", step_tokens=512.0, per_prompt=3,
                                              budget_gb=0.25, half_life=64.0, bucket_fit=True),
               span_maps=SpanMapConfig(budget_gb=0.5, host_gb=1.0))


def test_flat_keywords_and_groups_give_equal_configs():
    flat = Config.from_flat(block_size=32, **FLAT)
    assert flat == Config(block_size=32, **GROUPED)
    assert flat.kv_store.dir == "/tmp/store" and flat.hybrid_cache.budget_gb == 0.25
    assert Config.from_flat(**flat.to_flat()) == flat
    assert set(FLAT) <= set(flat.to_flat())  # every flat keyword is one of the groups' fields
    # a group object and flat keywords of the same group: the keywords win over the object's
    mixed = Config.from_flat(kv_store=KVStoreConfig(dir="/a", gb=2.0), kv_store_gb=3.0)
    assert mixed.kv_store == KVStoreConfig(dir="/a", gb=3.0)


def test_run_batch_flags_give_the_grouped_config(tmp_path):
    from minipic_jax.batch.options import build_parser, engine_args
    args = build_parser().parse_args(
        ["-i", "in.jsonl", "-o", "out.jsonl", "--kv-store-dir", str(tmp_path), "--kv-store-gb",
         "8", "--kv-store-spans-only", "--kv-store-staging-gb", "2", "--kv-store-pinned"])
    config = Config.from_flat(**engine_args(args))
    assert config.kv_store == KVStoreConfig(dir=str(tmp_path), gb=8.0, spans_only=True,
                                            staging_gb=2.0, pinned=True)


def test_unknown_or_removed_keywords_are_type_errors_naming_them():
    with pytest.raises(TypeError, match="'kv_store_dri'; did you mean 'kv_store_dir'"):
        Config.from_flat(kv_store_dri="/tmp")
    with pytest.raises(TypeError, match="'span_map_dtype' is no longer an option.*STATE_DTYPE"):
        Config.from_flat(span_map_dtype="bfloat16")
    from minipic_jax import LLM
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM("no/such/model", max_num_seq=4)  # before the model is looked for


def test_group_values_are_checked_naming_the_flat_keyword():
    with pytest.raises(ValueError, match=r"checkpoint_strategy \(Config.hybrid_cache.strategy\)"):
        Config.from_flat(checkpoint_strategy="often")
    with pytest.raises(ValueError, match="kv_store_gb"):
        Config(kv_store=KVStoreConfig(gb=0))
    with pytest.raises(ValueError, match="span_map_host_gb"):
        Config.from_flat(span_map_host_gb=-1)


# a changed value for every field: those only the host reads, then those that reach the step
HOST_ONLY = {"num_kv_blocks": 64, "gpu_memory_utilization": 0.5, "kv_mode": "pic_off",
             "hash_algo": "sha256", "scheduling_policy": "barrier", "isps_span_seats": 4,
             "cpu_offload_gb": 1.0, "max_logprobs": 5, "watermark_blocks": 2, "small_seq_bucket": 4,
             "step_cache": "off", "kv_store.dir": "/tmp/store", "kv_store.gb": 8.0,
             "kv_store.spans_only": True, "kv_store.staging_gb": 2.0, "kv_store.pinned": True,
             "hybrid_cache.strategy": "last", "hybrid_cache.step_tokens": 0.0,
             "hybrid_cache.per_prompt": 2, "hybrid_cache.budget_gb": 0.5,
             "hybrid_cache.half_life": 16.0, "hybrid_cache.bucket_fit": True,
             "hybrid_cache.free_room": False,
             "span_maps.budget_gb": 0.0, "span_maps.host_gb": 1.0, "span_maps.capture": "always"}
STEP = {"max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 1024,
        "block_size": 32, "enable_prefix_caching": False, "pad_token_id": 1, "ssep_token_id": 2,
        "pdep_token_id": 3, "min_token_bucket": 4, "attn_impl": "xla",
        "decode_attn_impl": "triton_decode", "decode_attn_options": {"rope": "table"},
        "write_kv_impl": "xla", "fuse_weights": False, "async_scheduling": False,
        "tensor_parallel_size": 2, "span_maps.compose_precision": "tf32_x3",
        "compilation.command_buffer": "on", "compilation.xla_memory_limit": "xla",
        "gdn.impl": "xla"}
BASE = Config(attn_impl="triton")  # so a decode_attn_options change is valid on its own


def host_only_fields(config) -> list[str]:
    """Dotted names of the fields marked host_only (groups included)."""
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.metadata.get("host_only"):
            out.append(f.name)
        elif dataclasses.is_dataclass(value):
            out += [f"{f.name}.{n}" for n in host_only_fields(value)]
    return out


def _changed(config, dotted, value):
    group, _, name = dotted.rpartition(".")
    if not group:
        return dataclasses.replace(config, **{name: value})
    return dataclasses.replace(
        config, **{group: dataclasses.replace(getattr(config, group), **{name: value})})


def test_every_field_is_classified():
    """A new field must be added to HOST_ONLY or STEP above (and marked accordingly)."""
    assert set(host_only_fields(BASE)) == set(HOST_ONLY)
    assert set(step_key_fields(BASE)) == set(STEP)


@pytest.mark.parametrize("name", sorted(HOST_ONLY))
def test_a_host_only_field_keeps_the_step_key(name):
    changed = _changed(BASE, name, HOST_ONLY[name])
    assert changed != BASE and step_key_fields(changed) == step_key_fields(BASE)


@pytest.mark.parametrize("name", sorted(STEP))
def test_a_step_field_changes_the_step_key(name):
    changed = _changed(BASE, name, STEP[name])
    assert step_key_fields(changed) != step_key_fields(BASE)


def test_engine_never_changes_the_callers_config_and_warns_on_isps_for_hybrid():
    """A hybrid model runs isps as fcfs: the engine's own copy says so, a warning names both, the
    caller's Config is unchanged; the runner keys its programs by step_key_fields (a host-only
    change keeps the context, a step field changes it)."""
    from minipic_jax.loading import load_model
    from serving.llm_engine import LLMEngine
    config = Config.from_flat(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128,
                              num_kv_blocks=32, scheduling_policy="isps", checkpoint_gb=0.001)
    before = copy.deepcopy(config)
    loaded = load_model("tiny_qwen3_5", dtype="float32", seed=0)
    with pytest.warns(UserWarning, match="scheduling_policy='isps'.*'fcfs'"):
        engine = LLMEngine(loaded, config, dtype=jnp.float32)
    assert config == before and config.scheduling_policy == "isps"
    assert engine.config.scheduling_policy == "fcfs"
    # ... and an unset small_seq_bucket takes its default (0 on a CPU backend)
    assert engine.config == dataclasses.replace(before, scheduling_policy="fcfs",
                                                small_seq_bucket=0)
    runner, context = engine.runner, engine.runner._program_context()
    runner.config = _changed(engine.config, "hybrid_cache.strategy", "last")
    assert runner._program_context() == context
    runner.config = _changed(engine.config, "write_kv_impl", "xla")
    assert runner._program_context() != context


def test_kv_store_pinned_is_a_field_not_an_environment_variable(monkeypatch):
    from serving.tiers import kv_store_buffers
    monkeypatch.setattr(kv_store_buffers, "pinned_shardings", lambda: ("pinned", "device"))
    monkeypatch.setenv("MINIPIC_KV_STORE_PINNED", "1")
    assert not kv_store_buffers.RunBuffers(2).pinned  # the variable is not read
    assert kv_store_buffers.RunBuffers(2, pinned=True).pinned
    monkeypatch.setattr(kv_store_buffers, "pinned_shardings", lambda: None)
    assert not kv_store_buffers.RunBuffers(2, pinned=True, required=False).pinned
    with pytest.raises(ValueError, match="pinned host buffers are not available"):
        kv_store_buffers.RunBuffers(2, pinned=True)
