"""benchmarks/hlo_kernels.py on CPU-compiled modules: the kernels a step launches, by the named
scope behind each (what a GPU profile's kernel names do not say)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import hlo_kernels


def _module(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def _layers(x, w, n=3):
    for i in range(n):
        with jax.named_scope(f"layer_{i}"), jax.named_scope("mlp"):
            x = jnp.tanh(x @ w) + x
            x = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True))
    return x


def test_every_layer_launches_the_same_kernels_and_names_resolve():
    text = _module(_layers, jnp.ones((8, 16)), jnp.ones((16, 16)))
    ks = hlo_kernels.kernels(text)
    per_layer = [sum(f"layer_{i}/" in k["op_name"] for k in ks) for i in range(3)]
    assert per_layer[0] > 0 and per_layer == [per_layer[0]] * 3, per_layer
    assert len(ks) == 3 * per_layer[0]  # nothing outside the layers
    lines = hlo_kernels.summary(ks)
    assert lines[0].startswith(f"{len(ks)} kernels; per layer: 0: {per_layer[0]}")
    assert any("layer_*/mlp" in line for line in lines[1:])
    k = ks[-1]  # a profile spells the HLO's `name.1` as `name_1`
    assert hlo_kernels.find(ks, k["name"].replace(".", "_")) == [k]
    assert hlo_kernels.find(ks, "no_such_fusion") == []


def test_kernels_inside_a_while_loop_are_found():
    def looped(x, w):
        def body(_, x):
            with jax.named_scope("layer_0"):
                return jnp.tanh(x @ w) * 2.0 + x
        return jax.lax.fori_loop(0, 4, body, x)
    ks = hlo_kernels.kernels(_module(looped, jnp.ones((8, 16)), jnp.ones((16, 16))))
    assert any("layer_0" in k["op_name"] for k in ks), ks


def test_a_text_that_is_no_module_is_refused(tmp_path):
    import pytest
    bad = tmp_path / "x.txt"
    bad.write_text("not an HLO module\n")
    with pytest.raises(SystemExit, match="no entry computation or no kernel"):
        hlo_kernels.main([str(bad)])
