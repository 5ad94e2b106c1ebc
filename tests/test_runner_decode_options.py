"""Decode-step kernel options the runner derives from the engine Config (serving/model_runner.py)."""

import minipic_jax  # noqa: F401  (package first: serving.model_runner imports it)
from serving.config import Config
from serving.model_runner import DEFAULT_TABLE_MAX_POSITION, _decode_options


def test_default_passes_the_position_bound_to_the_decode_kernel_only():
    cfg = Config(decode_attn_impl="triton_decode", max_model_len=300)
    assert _decode_options(cfg) == {"max_position": 300}
    # too long a context for an L2-sized table, another kernel, or options given: no bound added
    long = Config(decode_attn_impl="triton_decode", max_model_len=DEFAULT_TABLE_MAX_POSITION * 2)
    assert _decode_options(long) == {}
    assert _decode_options(Config(decode_attn_impl="xla", max_model_len=300)) == {}
    assert _decode_options(Config(decode_attn_impl="triton_decode", max_model_len=300,
                                  decode_attn_options={})) == {}
    assert _decode_options(Config(decode_attn_impl="triton_decode", max_model_len=300,
                                  decode_attn_options={"rope": "trig"})) == {"rope": "trig"}
    assert _decode_options(Config(decode_attn_impl="triton_decode", max_model_len=300,
                                  decode_attn_options={"rope": "table_bf16"})) == {
        "rope": "table_bf16", "max_position": 300}


def test_gpu_default_is_the_decode_choice_with_its_position_bound(monkeypatch):
    """On a GPU with attn_impl=None, decode-only steps take implementation="decode" (the Mosaic
    MMA kernel where it fits, else triton_decode) and get the max_model_len bound it needs."""
    from serving import model_runner
    monkeypatch.setattr(model_runner.jax, "default_backend", lambda: "gpu")
    cfg = Config(max_model_len=300)
    assert model_runner._decode_impl(cfg) == "decode"
    assert _decode_options(cfg) == {"max_position": 300}
    assert model_runner._decode_impl(Config(attn_impl="xla")) == "xla"
