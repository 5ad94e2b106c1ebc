"""The training step's fast paths against the plain one: the loss on gathered answer rows equals
the loss on full logits (value and gradients), remat policies change nothing, and the attention
choice is made in one place with clear errors. Plus the block-ft demonstration's task generator.
(cuDNN attention cannot run on CPU: `minipic-bench train` checks it against XLA fp32 on the GPU.)"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import block_ft_bench
from minipic_jax.loading import load_model
from minipic_jax.models import llama
from minipic_jax.models.llama_train import attn_implementation
from minipic_jax.prompts import Prompt, Span
from minipic_jax.training import TrainConfig, read_jsonl
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


def test_block_ft_questions_have_one_right_answer_and_fit(fresh_rng, tmp_path):
    """The asked key occurs exactly once among the documents and its value is the answer; every
    example lays out within the default seq_len in both layouts."""
    p = argparse.ArgumentParser()
    block_ft_bench.add_parser(p)
    args = p.parse_args([])
    tok = load_model("tiny_llama").tokenizer
    markers = Markers(block_size=args.block_size, pad_token_id=511, ssep_token_id=510,
                      pdep_token_id=509)
    for segs, answer in block_ft_bench.eval_set(args, fresh_rng)[:32]:
        docs = [s["text"] for s in segs if s["kind"] == "span"]  # facts "Kv;" (the default)
        key = segs[-1]["text"].lstrip("?")
        facts = [(f[0], f[1:]) for d in docs for f in d.split(";") if f]
        assert len(docs) == args.docs and [k for k, _ in facts].count(key) == 1
        assert dict(facts)[key] == answer
        rec = Record(tuple((Span if s["kind"] == "span" else Prompt)(s["text"]) for s in segs),
                     answer)
        for plain in (False, True):
            ex = layout_example(rec, markers, tok, eos_token_id=257, plain=plain)
            assert len(ex.tokens) <= args.seq_len and ex.loss_mask.sum() == 2
    path = tmp_path / "train.jsonl"  # training examples ask args.queries keys each
    block_ft_bench.write_train_data(path, argparse.Namespace(**{**vars(args), "train_examples": 16}),
                                    fresh_rng)
    for rec in read_jsonl(path):
        answer = rec.answer
        assert len(answer) == 3 * args.queries - 2 and answer[1::3] == "?" * (args.queries - 1)
        for plain, seq in ((False, args.seq_len), (True, args.pretrain_seq_len)):
            assert len(layout_example(rec, markers, tok, eos_token_id=257, plain=plain).tokens) <= seq
    block_ft_bench.write_train_data(path, argparse.Namespace(**{**vars(args), "train_examples": 16}),
                                    fresh_rng, copy_fraction=1.0)  # pretraining's copy examples
    for rec in read_jsonl(path):
        text = rec.segments[0].content
        assert text == f"copy:{rec.answer}|" and len(set(rec.answer)) == len(rec.answer)
        assert len(layout_example(rec, markers, tok, eos_token_id=257, plain=True).tokens) <= \
            args.pretrain_seq_len
