"""The engine's attention kernels come from the registry's one policy (choose_attention), asked
once at start with the model's shapes and max_model_len as the position bound
(serving/model_runner.attention_choices)."""

import jax.numpy as jnp
import pytest

from configs.presets import PRESETS
from kernels_pallas.paged_attention.problem import TABLE_MAX_POSITION
from serving.config import Config
from serving.step.model_runner import attention_choices

LLAMA_8B = PRESETS["llama3_8b"]  # 32 q / 8 kv heads, head_dim 128


def choices(platform="gpu", dtype=jnp.bfloat16, mcfg=LLAMA_8B, **config):
    return attention_choices(Config(**config), mcfg, dtype, platform)


def test_gpu_default_is_the_mixed_path_and_the_mosaic_decode_kernel_with_its_bound():
    (general, general_options), (decode, options) = choices(max_model_len=2048)
    assert general == "mixed" and decode == "mosaic_decode"
    assert general_options.max_position == 2048  # its decode rows read the same table
    assert (options.max_position, options.pages_per_step, options.stages, options.kv_group,
            options.packed) == (2048, 2, 2, 2, True)  # measured defaults, block 16 -> 32 keys
    # too long a context for an L2-sized table: the Mosaic kernel (table only) does not fit
    (_, _), (decode, options) = choices(max_model_len=TABLE_MAX_POSITION * 2)
    assert decode == "triton_decode" and options.rope == "trig" and options.max_position is None
    (general, _), (decode, _) = choices(dtype=jnp.float32)  # f32: not a Mosaic dtype
    assert general == "triton" and decode == "triton_decode"


def test_named_decode_kernel_gets_the_position_bound():
    (_, _), (decode, options) = choices(decode_attn_impl="triton_decode", max_model_len=300)
    assert decode == "triton_decode" and (options.rope, options.max_position) == ("table_bf16",
                                                                                 300)
    (_, _), (_, options) = choices(decode_attn_impl="triton_decode", max_model_len=300,
                                   decode_attn_options={"rope": "trig"})
    assert (options.rope, options.max_position) == ("trig", None)
    long = TABLE_MAX_POSITION * 2  # a table named explicitly gets max_model_len, however long
    (_, _), (_, options) = choices(decode_attn_impl="triton_decode", max_model_len=long,
                                   decode_attn_options={"rope": "table_bf16"})
    assert (options.rope, options.max_position) == ("table_bf16", long)


def test_cpu_and_xla_compile_no_separate_decode_variant():
    general, decode = choices(platform="cpu")
    assert general == decode == ("xla", general[1])
    general, decode = choices(attn_impl="xla")
    assert general == decode and general[0] == "xla"


def test_bad_choices_are_errors_before_any_work():
    with pytest.raises(ValueError, match="decode-only"):
        choices(attn_impl="triton_decode")
    with pytest.raises(ValueError, match="needs a named decode_attn_impl"):
        Config(decode_attn_options={"rope": "trig"})
    with pytest.raises(ValueError, match="unknown options"):
        choices(decode_attn_impl="triton_decode", decode_attn_options={"consumers": 2})
