"""The block-ft demonstration's task generators (benchmarks/block_ft_bench.py, block_ft_sections.py):
every question has exactly one right answer, the sections task cannot be answered from the key
alone, and every example lays out within the task's default sequence lengths in both layouts."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import block_ft_bench
from minipic_jax.loading import load_model
from minipic_jax.prompts import Prompt, Span
from minipic_jax.training import read_jsonl
from minipic_jax.training.data import Markers, Record, layout_example


def _args(*argv):
    p = argparse.ArgumentParser()
    block_ft_bench.add_parser(p)
    return block_ft_bench.resolve(p.parse_args(list(argv)))


def _fits(rec, args, tok, answer_len):
    markers = Markers(block_size=args.block_size, pad_token_id=511, ssep_token_id=510,
                      pdep_token_id=509)
    for plain, seq in ((False, args.seq_len), (True, args.pretrain_seq_len)):
        ex = layout_example(rec, markers, tok, eos_token_id=257, plain=plain)
        assert len(ex.tokens) <= seq and ex.loss_mask.sum() == answer_len + 1


def _record(segs, answer):
    return Record(tuple((Span if s["kind"] == "span" else Prompt)(s["text"]) for s in segs), answer)


def _train_records(args, rng, tmp_path, copy_fraction=0.0):
    path = tmp_path / "train.jsonl"
    block_ft_bench.write_train_data(
        path, argparse.Namespace(**{**vars(args), "train_examples": 16}), rng, copy_fraction)
    return read_jsonl(path)


def _copy_records_fit(args, rng, tmp_path, tok):
    for rec in _train_records(args, rng, tmp_path, copy_fraction=1.0):  # pretraining's copies
        text = rec.segments[0].content
        assert text == f"copy:{rec.answer}|" and len(set(rec.answer)) == len(rec.answer)
        _fits(rec, args, tok, len(rec.answer))


def test_retrieval_questions_have_one_right_answer_and_fit(fresh_rng, tmp_path):
    """The asked key occurs exactly once among the documents and its value is the answer."""
    args = _args("--task", "retrieval")
    tok = load_model("tiny_llama").tokenizer
    for segs, answer in block_ft_bench.eval_set(args, fresh_rng)[:32]:
        docs = [s["text"] for s in segs if s["kind"] == "span"]  # facts "Kv;" (the default)
        key = segs[-1]["text"].lstrip("?")
        facts = [(f[0], f[1:]) for d in docs for f in d.split(";") if f]
        assert len(docs) == args.docs and [k for k, _ in facts].count(key) == 1
        assert dict(facts)[key] == answer
        _fits(_record(segs, answer), args, tok, 1)
    for rec in _train_records(args, fresh_rng, tmp_path):  # args.queries keys each
        assert len(rec.answer) == 3 * args.queries - 2
        assert rec.answer[1::3] == "?" * (args.queries - 1)
        _fits(rec, args, tok, len(rec.answer))
    _copy_records_fit(args, fresh_rng, tmp_path, tok)


def _sections(segs):
    """{namespace: {field: value}} from header spans "3$" and table spans "$AbCd..."."""
    spans = [s["text"] for s in segs if s["kind"] == "span"]
    out = {}
    for header, table in zip(spans[::2], spans[1::2]):
        ns, tag = header
        assert table[0] == tag  # the table repeats its header's tag: the local link
        fields = dict(zip(table[1::2], table[2::2]))
        assert len(fields) * 2 + 1 == len(table)
        out[ns] = fields
    return out


def test_sections_questions_need_the_header_and_fit(fresh_rng, tmp_path):
    """The answer is the asked field's value in the table after the asked namespace's header;
    every table has every field, so the field alone does not say which value."""
    args = _args()
    assert (args.task, args.layers, args.block_size) == ("sections", 4, 8)
    tok = load_model("tiny_llama").tokenizer
    for segs, answer in block_ft_bench.eval_set(args, fresh_rng)[:32]:
        secs = _sections(segs)
        q = segs[-1]["text"]
        assert len(secs) == args.sections and q[0] == "?" and len(q) == 3
        tags = [s["text"][1] for s in segs if s["kind"] == "span"][::2]
        assert len(set(tags)) == args.sections
        assert all(set(t) == set(secs[q[1]]) and len(t) == args.fields for t in secs.values())
        assert secs[q[1]][q[2]] == answer
        _fits(_record(segs, answer), args, tok, 1)
    for rec in _train_records(args, fresh_rng, tmp_path):
        secs = _sections([{"kind": type(s).__name__.lower(), "text": s.content}
                          for s in rec.segments])
        first = rec.segments[-1].content
        asks = [(first[1], first[2], rec.answer[0])] + [
            (rec.answer[i + 1], rec.answer[i + 2], rec.answer[i + 3])
            for i in range(1, len(rec.answer), 4)]
        assert rec.answer[1::4] == "?" * (args.queries - 1)
        assert len(asks) == args.queries and len(set(a[:2] for a in asks)) == args.queries
        assert all(secs[ns][k] == v for ns, k, v in asks)
        _fits(rec, args, tok, len(rec.answer))
    _copy_records_fit(args, fresh_rng, tmp_path, tok)


@pytest.mark.parametrize("argv, match", [(("--sections", "1"), "--sections"),
                                         (("--fields", "9"), "--fields"),
                                         (("--sections", "2", "--fields", "1"), "--queries")])
def test_sections_arguments_are_checked(argv, match):
    with pytest.raises(ValueError, match=match):
        _args(*argv)
