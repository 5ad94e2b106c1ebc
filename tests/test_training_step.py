"""The training step's fast paths against the plain one: the loss on gathered answer rows equals
the loss on full logits (value and gradients), remat policies change nothing, and the attention
choice is made in one place with clear errors.
(cuDNN attention cannot run on CPU: `minipic-bench train` checks it against XLA fp32 on the GPU.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minipic_jax.loading import load_model
from minipic_jax.models import llama
from minipic_jax.models.llama_train import attn_implementation
from minipic_jax.prompts import Prompt, Span
from minipic_jax.training import TrainConfig
from minipic_jax.training.batch import make_batch
from minipic_jax.training.data import Markers, Record, layout_example
from minipic_jax.training.step import answer_loss, answer_rows, max_loss_rows, rows_loss


def _batch(rng, n=3):
    toks = lambda lo, hi: tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(lo, hi))))
    markers = Markers(block_size=8, pad_token_id=511, ssep_token_id=510, pdep_token_id=509)
    examples = [layout_example(Record((Prompt(toks(2, 9)),) + tuple(Span(toks(3, 20))
                                                                       for _ in range(k)),
                                      toks(1, 5)), markers, None, eos_token_id=257)
                for k in range(n)]
    seq = max(len(e.tokens) for e in examples) + 5  # batch padding too
    return make_batch(examples, seq), max_loss_rows([e.loss_mask.sum() for e in examples], n)


def test_answer_rows_loss_equals_full_logits_loss(fresh_rng):
    """Value and gradient of the gathered-rows loss (remat 'dots') against the full-logits loss
    (no remat), fp32."""
    cfg = dataclasses.replace(load_model("tiny_llama").cfg, num_layers=1)  # compile time
    params = llama.init_params(cfg, jax.random.key(int(fresh_rng.integers(1 << 30))))
    batch, num_rows = _batch(fresh_rng)
    fwd = lambda p, **kw: llama.training_forward(p, batch.tokens, batch.positions, batch.windows,
                                                 batch.valid, cfg, **kw)

    def full(p):
        return answer_loss(fwd(p, remat=False), batch)[0]

    def rows(p):
        r, keep = answer_rows(jnp.asarray(batch.loss_mask), num_rows)
        return rows_loss(fwd(p, remat="dots", rows=r), jnp.asarray(batch.targets).reshape(-1)[r],
                         keep)[0]

    (lf, gf), (lr, gr) = (jax.jit(jax.value_and_grad(f))(params) for f in (full, rows))
    assert abs(float(lf) - float(lr)) < 1e-5 * abs(float(lf))
    for a, b in zip(jax.tree.leaves(gf), jax.tree.leaves(gr)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * np.abs(np.asarray(a)).max()


def test_answer_rows_are_in_order_and_padding_is_dropped():
    mask = np.zeros((2, 6), bool)
    mask[0, [2, 3]] = mask[1, [5]] = True
    rows, keep = answer_rows(jnp.asarray(mask), 8)
    assert np.asarray(rows)[:3].tolist() == [2, 3, 11]
    assert np.asarray(keep).tolist() == [True] * 3 + [False] * 5
    assert max_loss_rows([3, 1, 2], batch_size=5) == 16  # 5 x 3 rounded up to 8


def test_attention_choice_and_remat_are_checked():
    assert attn_implementation(None, jnp.bfloat16) == "xla"
    assert attn_implementation("auto", jnp.bfloat16) == "xla"  # CPU
    assert attn_implementation("cudnn", jnp.bfloat16) == "cudnn"
    with pytest.raises(ValueError, match="cudnn.*bfloat16 or float16"):
        attn_implementation("cudnn", jnp.float32)
    with pytest.raises(ValueError, match="attn_impl must be"):
        attn_implementation("flash", jnp.bfloat16)
    base = dict(model="tiny_llama", data="x.jsonl", out_dir="o")
    assert TrainConfig(**base, remat=False).remat == "none"
    assert TrainConfig(**base, remat=True).remat == "full"
    with pytest.raises(ValueError, match="TrainConfig.remat"):
        TrainConfig(**base, remat="some")
    with pytest.raises(ValueError, match="TrainConfig.attn_impl"):
        TrainConfig(**base, attn_impl="flash")
