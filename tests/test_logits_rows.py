"""The LM head's rows padded (minipic_jax/models/layers.PAD_LOGITS_ROWS): a small-batch step's
head took 0.65-0.87 ms on an H100 at 8-16 rows where 64 rows took 0.32 (s29d)."""

import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.parametrize("n", [1, 8, 16, 63, 64])
def test_padded_logits_rows_are_the_rows_logits(fresh_rng, monkeypatch, n):
    """layers.PAD_LOGITS_ROWS (the LM head's rows padded to 64 from 8 rows on): the same logits
    for the real rows within float32 accumulation order (the same bits on an H100 at 8 / 16
    rows, s29d), tied and untied, shapes unchanged."""
    from minipic_jax.models import layers
    x = jnp.asarray(fresh_rng.standard_normal((n, 32)), jnp.bfloat16)
    table = jnp.asarray(fresh_rng.standard_normal((300, 32)), jnp.bfloat16)
    want = (layers.tied_logits(x, table), layers.logits_from_hidden(x, table.T))
    monkeypatch.setattr(layers, "PAD_LOGITS_ROWS", True)
    got = (layers.tied_logits(x, table), layers.logits_from_hidden(x, table.T))
    for g, w in zip(got, want):
        assert g.shape == (n, 300) and g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
