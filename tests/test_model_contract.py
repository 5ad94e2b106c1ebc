"""The model contract (serving/model_contract.py): the families implement it, and a family that
lacks a member is refused at engine start with the member's name."""

import types

import pytest

from minipic_jax.models import llama, qwen3_5
from serving.model_contract import HybridModelFamily, ModelFamily, check_family


def test_families_implement_the_contract():
    for family in (llama, qwen3_5):
        check_family(family)
        assert isinstance(family, ModelFamily)
    assert isinstance(qwen3_5, HybridModelFamily) and qwen3_5.IS_HYBRID
    assert not llama.IS_HYBRID


def test_a_family_missing_a_member_is_named():
    stub = types.ModuleType("stub_family")
    for name in ("config_from_hf", "init_params", "param_axes", "convert_hf", "hf_tensor_names",
                 "fuse_params", "init_cache"):
        setattr(stub, name, lambda *a, **k: None)
    stub.IS_HYBRID = False
    with pytest.raises(TypeError, match="stub_family .* missing forward"):
        check_family(stub)
    stub.forward = lambda *a, **k: None
    check_family(stub)
    stub.IS_HYBRID = True  # a hybrid family needs the checkpoint hooks too
    with pytest.raises(TypeError, match="HybridModelFamily: missing CHUNK, extract_state, "
                                        "forward_with_checkpoints, restore_state, state_nbytes"):
        check_family(stub)
