"""minipic-bench block-ft: does block fine-tuning recover the accuracy Block-Attention costs?

A synthetic multi-document retrieval task: documents are lists of key=value facts ("k37=v05;"),
a question names one key ("k37?") and the answer is its value ("v05"). A small model is trained
from scratch with full attention (the plain layout), then evaluated through the engine:
  (a) full attention: the documents and question as one plain prompt;
  (b) Block-Attention: each document a Span (cached once, reused across questions at any offset);
  (c) (b) after block fine-tuning (`minipic-train` on the block layout, half plain examples).
Reports the three accuracies, the prefix-cache hit rate of (b)/(c) and the share of the (a)->(b)
loss that (c) recovers. Everything runs through `minipic_jax.training` and `LLM`.
"""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np


def add_parser(p):
    p.add_argument("--model", default="tiny_llama", help="preset (random init: from scratch)")
    p.add_argument("--docs", type=int, default=4, help="documents per question")
    p.add_argument("--facts", type=int, default=4, help="facts per document")
    p.add_argument("--train-examples", type=int, default=4096,
                   help="synthetic questions in train.jsonl (default: %(default)s)")
    p.add_argument("--pool", type=int, default=16, help="distinct documents in the eval set")
    p.add_argument("--eval", type=int, default=128, help="eval questions")
    p.add_argument("--pretrain-steps", type=int, default=2000,
                   help="from-scratch training steps, full attention (default: %(default)s)")
    p.add_argument("--ft-steps", type=int, default=500,
                   help="block fine-tuning steps (half plain examples) (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="training batch size (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16,
                   help="KV block size for training and the engine (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256,
                   help="training sequence length; engine max_model_len is this + 16 "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="data and training seed (default: %(default)s)")
    p.add_argument("--out", default=os.environ.get("OUT", "block_ft"),
                   help="output folder: data, checkpoints, block_ft.json (default: %(default)s)")


def _doc(rng, facts):
    keys = rng.choice(100, facts, replace=False)
    return [(f"k{k:02d}", f"v{rng.integers(100):02d}") for k in keys]


def _question(rng, docs):
    """(segments, answer): a system prompt, one span per document, the question."""
    seen, pairs = set(), []
    for d in docs:
        for k, v in d:
            if k not in seen:  # a key repeated across documents: the first one counts
                seen.add(k)
                pairs.append((k, v))
    k, v = pairs[rng.integers(len(pairs))]
    segs = [{"kind": "prompt", "text": "facts:"}]
    segs += [{"kind": "span", "text": "".join(f"{a}={b};" for a, b in d)} for d in docs]
    segs.append({"kind": "prompt", "text": f" {k}?"})
    return segs, v


def write_train_data(path, args, rng):
    with open(path, "w") as f:
        for _ in range(args.train_examples):
            docs = [_doc(rng, args.facts) for _ in range(args.docs)]
            segs, answer = _question(rng, docs)
            f.write(json.dumps({"segments": segs, "answer": answer}) + "\n")


def eval_set(args, rng):
    pool = [_doc(rng, args.facts) for _ in range(args.pool)]
    return [_question(rng, [pool[i] for i in rng.choice(args.pool, args.docs, replace=False)])
            for _ in range(args.eval)]


def evaluate(folder, questions, args, *, blocks: bool) -> dict:
    from minipic_jax import LLM, Prompt, SamplingParams, Span
    llm = LLM(str(folder), dtype="float32", block_size=args.block_size, max_num_seqs=32,
              max_model_len=args.seq_len + 16, num_kv_blocks=4096)
    tok = llm.get_tokenizer()
    prompts = []
    for segs, _ in questions:
        if blocks:
            prompts.append([(Span if s["kind"] == "span" else Prompt)(s["text"]) for s in segs])
        else:  # the plain layout minipic-train uses: one full-attention prompt
            ids = tok.encode(segs[0]["text"])
            for s in segs[1:]:
                more = tok.encode(s["text"])
                ids += more[1:] if more and more[0] == tok.bos_token_id else more
            prompts.append(ids)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    right = sum(o.outputs[0].text.startswith(ans) for o, (_, ans) in zip(outs, questions))
    stats = llm.llm_engine.get_stats()
    return {"accuracy": right / len(questions), "hit_rate": stats["prefix_cache_hit_rate"]}


def _train(args, data, out, *, model, steps, plain_fraction):
    from minipic_jax.training import TrainConfig, train
    return train(TrainConfig(model=str(model), data=str(data), out_dir=str(out), steps=steps,
                             batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                             warmup_steps=min(100, steps // 10), block_size=args.block_size,
                             plain_fraction=plain_fraction, seed=args.seed, export_dtype="float32",
                             checkpoint_every=0))


def run(args):
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    write_train_data(out / "train.jsonl", args, rng)
    questions = eval_set(args, rng)
    base = _train(args, out / "train.jsonl", out / "pretrain", model=args.model,
                  steps=args.pretrain_steps, plain_fraction=1.0)
    res = {"a_full_attention": evaluate(base, questions, args, blocks=False),
           "b_block_attention": evaluate(base, questions, args, blocks=True)}
    tuned = _train(args, out / "train.jsonl", out / "block_ft", model=base, steps=args.ft_steps,
                   plain_fraction=0.5)
    res["c_block_ft"] = evaluate(tuned, questions, args, blocks=True)
    a, b, c = (res[k]["accuracy"] for k in ("a_full_attention", "b_block_attention", "c_block_ft"))
    res["recovered"] = (c - b) / (a - b) if a > b else None
    res["args"] = vars(args)
    (out / "block_ft.json").write_text(json.dumps(res, indent=2, default=str))
    rec = "n/a (no loss)" if res["recovered"] is None else f"{res['recovered']:.0%}"
    print(f"accuracy: (a) full attention {a:.3f}, (b) Block-Attention {b:.3f} (cache hit rate "
          f"{res['b_block_attention']['hit_rate']:.2f}), (c) after block fine-tuning {c:.3f}; "
          f"recovered {rec} of the (a)->(b) loss")
    return 0
