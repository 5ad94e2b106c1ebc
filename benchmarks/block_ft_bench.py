"""minipic-bench block-ft: does block fine-tuning recover the accuracy Block-Attention costs?

A small model is trained from scratch with full attention (the plain layout) on a synthetic
multi-document task, on training questions that ask several things each, mixed with copy examples
(dense induction targets, so the look-up circuit forms in hundreds of steps instead of thousands),
then evaluated through the engine on one-thing questions over documents from a small pool:
  (a) full attention: the documents and question as one plain prompt;
  (b) Block-Attention: each document a Span (cached once, reused across questions at any offset);
  (c) (b) after block fine-tuning (`minipic-train` on the block layout, --ft-plain-fraction
      plain examples, questions only).
Reports the three accuracies (with their standard errors), the prefix-cache hit rate of (b)/(c),
the share of the (a)->(b) loss that (c) recovers, and (a) again after fine-tuning. Everything
runs through `minipic_jax.training` and `LLM`.

Tasks (--task):
  sections (the default, benchmarks/block_ft_sections.py): facts whose meaning depends on a header
    in an earlier document. A full-attention model labels each table with the namespace of the
    header before it while reading it; Block-Attention hides the header from the table, and only
    the question can link them (through a tag both documents carry), which the model must learn.
  retrieval: documents are lists of key-value facts ("Kv;", one byte-level token per key and
    value), a question names one key ("?K") and the answer is its value ("v"), the key occurring
    once among the documents: the classic induction pattern. Nothing in a document needs another
    document, so a model that learned it loses nothing to Block-Attention (RESULTS.md "Training").
With --model an HF folder or a .gguf file, a real pretrained model is block fine-tuned instead, on
a natural-language RAG task (benchmarks/block_ft_real.py; the options of its group below).
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np

from benchmarks import block_ft_real, block_ft_sections

# per task: the defaults of the options given as None. sections: the Block-Attention answer takes
# two dependent look-ups after the previous-token layer, so 3 layers at the least
TASK_DEFAULTS = {
    "sections": dict(layers=4, block_size=8, seq_len=72, pretrain_seq_len=40, queries=3),
    "retrieval": dict(layers=2, block_size=16, seq_len=96, pretrain_seq_len=64, queries=4),
}
SYNTHETIC_DEFAULTS = dict(lr=2e-3, batch_size=128)  # of the options the real recipe shares


def add_parser(p):
    p.add_argument("--model", default="tiny_llama",
                   help="preset (random init: from scratch), or an HF folder or .gguf file: block "
                        "fine-tuning of that real model (benchmarks/block_ft_real.py)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (overrides the preset; default: sections 4, retrieval 2)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (overrides the preset)")
    p.add_argument("--heads", type=int, default=4,
                   help="attention heads, as many KV heads (overrides the preset)")
    p.add_argument("--task", choices=("sections", "retrieval"), default="sections",
                   help="sections: facts whose meaning depends on a header in an earlier document "
                        "(benchmarks/block_ft_sections.py); retrieval: key -> value facts, the "
                        "question asks one key (no cross-document reading needed) "
                        "(default: %(default)s)")
    block_ft_sections.add_arguments(p)
    p.add_argument("--docs", type=int, default=4, help="retrieval: documents per question")
    p.add_argument("--facts", type=int, default=3, help="retrieval: facts per document")
    p.add_argument("--fact", default="{k}{v};",
                   help="how a fact is written, {k} key and {v} value (default: %(default)s)")
    p.add_argument("--question", default="?{k}",
                   help="how the question is written, {k} the key (default: %(default)s)")
    p.add_argument("--ask", choices=("unique", "first"), default="unique",
                   help="unique: ask keys that occur once; first: keys may repeat across "
                        "documents and the first occurrence counts (the eval then asks only "
                        "repeated keys) (default: %(default)s)")
    p.add_argument("--queries", type=int, default=None,
                   help="look-ups asked (and answered) per training example (default: sections 3, "
                        "retrieval 4)")
    p.add_argument("--copy-fraction", type=float, default=0.5,
                   help="share of copy examples in the pretraining data (default: %(default)s)")
    p.add_argument("--copy-length", type=int, default=16,
                   help="letters per copy example (default: %(default)s)")
    p.add_argument("--train-examples", type=int, default=32768,
                   help="records in pretrain.jsonl (default: %(default)s)")
    p.add_argument("--ft-examples", type=int, default=None,
                   help="questions in train.jsonl, the block fine-tuning data (default: "
                        "--train-examples)")
    p.add_argument("--pool", type=int, default=16, help="distinct documents in the eval set")
    p.add_argument("--eval", type=int, default=128, help="eval questions")
    p.add_argument("--pretrain-steps", type=int, default=1000,
                   help="from-scratch training steps, full attention (default: %(default)s)")
    p.add_argument("--ft-steps", type=int, default=300,
                   help="block fine-tuning steps (half plain examples) (default: %(default)s)")
    p.add_argument("--ft-plain-fraction", type=float, default=0.5,
                   help="share of plain (full-attention) examples in the block fine-tuning, so the "
                        "model keeps both modes (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="training batch size (default: 128; real model 32)")
    p.add_argument("--ft-batch-size", type=int, default=64,
                   help="block fine-tuning batch size (default: %(default)s)")
    p.add_argument("--base", default=None,
                   help="skip pretraining: evaluate and fine-tune this HF folder (an earlier "
                        "run's pretrain/export, trained on the same task settings)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 2e-3; real model: 5e-5, LoRA 5e-4)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size for training and the engine (default: sections 8, "
                        "retrieval 16, real model 16)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="training sequence length; engine max_model_len is this + 16 "
                        "(default: sections 72, retrieval 96, real model 512)")
    p.add_argument("--pretrain-seq-len", type=int, default=None,
                   help="sequence length of the full-attention pretraining (plain layout, no "
                        "pads or markers) (default: sections 40, retrieval 64)")
    p.add_argument("--seed", type=int, default=0,
                   help="data and training seed (default: %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no training progress bars")
    p.add_argument("--out", default=os.environ.get("OUT", "block_ft"),
                   help="output folder: data, checkpoints, block_ft.json (default: %(default)s)")
    block_ft_real.add_arguments(p)


KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # one byte-level token each
VALUES = "abcdefghijklmnopqrstuvwxyz"


def _doc(rng, facts):
    keys = rng.choice(len(KEYS), facts, replace=False)
    return [(KEYS[k], VALUES[rng.integers(len(VALUES))]) for k in keys]


def _question(rng, docs, fact="{k}{v};", question="?{k}", queries=1, ask="unique"):
    """(segments, answer): a system prompt, one span per document, the question.

    The question asks for a key that occurs exactly once among the documents, so the answer is
    never ambiguous (keys repeated across documents stay as distractors). With queries > 1 (the
    training data) the answer goes on to ask and answer more such keys ("x?By?Cz"): each value is
    a supervised retrieval, several per example instead of one; the eval asks one key."""
    count = {}
    for d in docs:
        for k, _ in d:
            count[k] = count.get(k, 0) + 1
    if ask == "unique":
        pairs = [(k, v) for d in docs for k, v in d if count[k] == 1]
    else:  # "first": any key, its first occurrence counts; "first-dup": only repeated keys
        first = {}
        for d in docs:
            for k, v in d:
                first.setdefault(k, v)
        pairs = [(k, v) for k, v in first.items() if ask == "first" or count[k] > 1]
    if len(pairs) < queries:
        return None
    asked = [pairs[i] for i in rng.choice(len(pairs), queries, replace=False)]
    segs = [{"kind": "prompt", "text": "facts:"}]
    segs += [{"kind": "span", "text": "".join(fact.format(k=a, v=b) for a, b in d)} for d in docs]
    segs.append({"kind": "prompt", "text": question.format(k=asked[0][0])})
    return segs, asked[0][1] + "".join(question.format(k=k) + v for k, v in asked[1:])


def _sample(rng, draw_docs, args, queries=1, ask="unique"):
    """A question over freshly drawn documents (redrawn when too few keys qualify)."""
    while (q := _question(rng, draw_docs(), args.fact, args.question, queries, ask)) is None:
        pass
    return q


def _copy_record(rng, length):
    """A copy example: distinct letters, then the same letters again as the answer. Every answer
    token is an induction target (find the current token earlier, emit its successor), the
    circuit the retrieval needs, so the from-scratch model finds it far sooner. The length is
    drawn from [length / 2, length]: at one fixed length a fixed-offset head copies without
    induction (seen: loss down in 150 steps, retrieval still at chance)."""
    letters = KEYS + VALUES
    n = int(rng.integers(length // 2, length + 1))
    text = "".join(letters[i] for i in rng.choice(len(letters), n, replace=False))
    return {"segments": [{"kind": "prompt", "text": f"copy:{text}|"}], "answer": text}


def resolve(args):
    """Fill the task's defaults (TASK_DEFAULTS) and check the task's arguments."""
    for name, value in {**SYNTHETIC_DEFAULTS, **TASK_DEFAULTS[args.task]}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.task == "sections":
        block_ft_sections.check(args)
    return args


def write_train_data(path, args, rng, copy_fraction=0.0, count=None):
    """train.jsonl: `count` (default args.train_examples) of the task's questions; with
    copy_fraction > 0 (the pretraining file), that share of the records are copy examples."""
    count = count or args.train_examples
    if args.task == "sections":
        return block_ft_sections.write_train_data(
            path, args, rng, count, copy_fraction, lambda r: _copy_record(r, args.copy_length))
    with open(path, "w") as f:
        for _ in range(count):
            if rng.random() < copy_fraction:
                rec = _copy_record(rng, args.copy_length)
            else:
                segs, answer = _sample(
                    rng, lambda: [_doc(rng, args.facts) for _ in range(args.docs)], args,
                    args.queries, args.ask)
                rec = {"segments": segs, "answer": answer}
            f.write(json.dumps(rec) + "\n")


def eval_set(args, rng):
    """Questions over documents drawn from a pool of args.pool, so spans repeat (cache hits)."""
    if args.task == "sections":
        return block_ft_sections.eval_set(args, rng)
    pool = [_doc(rng, args.facts) for _ in range(args.pool)]
    pick = lambda: [pool[i] for i in rng.choice(args.pool, args.docs, replace=False)]
    ask = "first-dup" if args.ask == "first" else args.ask  # eval: where the rule matters
    return [_sample(rng, pick, args, 1, ask) for _ in range(args.eval)]


def evaluate(folder, questions, args, *, blocks: bool) -> dict:
    from minipic_jax import LLM, Prompt, SamplingParams, Span
    t0 = time.perf_counter()
    # XLA paged attention: accuracy is the question here, and it compiles fastest at this size
    llm = LLM(str(folder), dtype="float32", block_size=args.block_size, max_num_seqs=32,
              max_model_len=args.seq_len + 16, num_kv_blocks=4096, attn_impl="xla")
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
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))
    right = sum(o.outputs[0].text.startswith(ans) for o, (_, ans) in zip(outs, questions))
    stats = llm.llm_engine.get_stats()
    acc = right / len(questions)
    return {"accuracy": acc, "se": float(np.sqrt(acc * (1 - acc) / len(questions))),
            "hit_rate": stats["prefix_cache_hit_rate"], "s": time.perf_counter() - t0}


def init_model(args, out) -> pathlib.Path:
    """The from-scratch model: the preset with the size overrides, random weights, as an HF folder
    (the byte-level tokenizer comes from the vocabulary)."""
    import dataclasses

    import jax

    from configs.presets import get_preset
    from minipic_jax.models import llama
    from minipic_jax.training.export import export_hf
    cfg = dataclasses.replace(get_preset(args.model), num_layers=args.layers,
                              hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                              num_heads=args.heads, num_kv_heads=args.heads,
                              head_dim=args.hidden // args.heads)
    return export_hf(llama.init_params(cfg, jax.random.key(args.seed)), cfg, llama, out)


def _train(args, data, out, *, model, steps, plain_fraction, seq_len, batch_size):
    from minipic_jax.training import TrainConfig, Trainer
    # fp32 without remat: at this size that is the fastest on a CPU, and the engine evals in fp32
    tc = TrainConfig(model=str(model), data=str(data), out_dir=str(out), steps=steps,
                     batch_size=batch_size, seq_len=seq_len, lr=args.lr,
                     warmup_steps=min(100, steps // 10), block_size=args.block_size,
                     plain_fraction=plain_fraction, seed=args.seed, export_dtype="float32",
                     checkpoint_every=0, compute_dtype="float32", remat=False,
                     progress=args.progress)
    trainer = Trainer(tc)
    hist = trainer.run()
    tail = hist[-min(50, len(hist)):]
    return trainer.export(), {"first_loss": hist[0]["loss"],
                              "last_loss_mean50": float(np.mean([h["loss"] for h in tail]))}


def _recovered_se(res) -> float:
    """Standard error of (c - b) / (a - b), first order, treating the three accuracies as
    independent binomial estimates (they share questions, so this is an upper-side guess)."""
    (a, sa), (b, sb), (c, sc) = ((res[k]["accuracy"], res[k]["se"]) for k in
                                 ("a_full_attention", "b_block_attention", "c_block_ft"))
    r = (c - b) / (a - b)
    return float(np.sqrt(sc ** 2 + (1 - r) ** 2 * sb ** 2 + r ** 2 * sa ** 2) / (a - b))


def run(args):
    if block_ft_real.is_real_model(args.model):
        return block_ft_real.run(args)
    resolve(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    write_train_data(out / "train.jsonl", args, rng, count=args.ft_examples)
    write_train_data(out / "pretrain.jsonl", args, rng, copy_fraction=args.copy_fraction)
    questions = eval_set(args, rng)
    res = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}}
    save = lambda: (out / "block_ft.json").write_text(json.dumps(res, indent=2, default=str))
    t0 = time.perf_counter()
    if args.base:  # a model pretrained by an earlier run (its pretrain/export)
        base = pathlib.Path(args.base)
    else:
        base, res["pretrain"] = _train(args, out / "pretrain.jsonl", out / "pretrain",
                                       model=init_model(args, out / "init"),
                                       steps=args.pretrain_steps, plain_fraction=1.0,
                                       seq_len=args.pretrain_seq_len, batch_size=args.batch_size)
        res["pretrain"]["s"] = time.perf_counter() - t0
    res["a_full_attention"] = evaluate(base, questions, args, blocks=False)
    res["b_block_attention"] = evaluate(base, questions, args, blocks=True)
    save()
    print(f"(a) full attention {res['a_full_attention']['accuracy']:.3f}, (b) Block-Attention "
          f"{res['b_block_attention']['accuracy']:.3f}")
    t0 = time.perf_counter()
    tuned, res["block_ft"] = _train(args, out / "train.jsonl", out / "block_ft", model=base,
                                    steps=args.ft_steps, plain_fraction=args.ft_plain_fraction,
                                    seq_len=args.seq_len,
                                    batch_size=args.ft_batch_size or args.batch_size)
    res["block_ft"]["s"] = time.perf_counter() - t0
    res["c_block_ft"] = evaluate(tuned, questions, args, blocks=True)
    a, b, c = (res[k]["accuracy"] for k in ("a_full_attention", "b_block_attention", "c_block_ft"))
    res["recovered"] = (c - b) / (a - b) if a > b else None
    res["recovered_se"] = _recovered_se(res) if a > b else None
    save()
    rec = ("n/a (no loss)" if res["recovered"] is None
           else f"{res['recovered']:.0%} (SE {res['recovered_se']:.0%})")
    print(f"accuracy: (a) full attention {a:.3f}, (b) Block-Attention {b:.3f} (cache hit rate "
          f"{res['b_block_attention']['hit_rate']:.2f}), (c) after block fine-tuning {c:.3f} "
          f"(hit rate {res['c_block_ft']['hit_rate']:.2f}); recovered {rec} of the (a)->(b) loss")
    res["c_full_attention_after_ft"] = evaluate(tuned, questions, args, blocks=False)
    save()
    print(f"full attention after block fine-tuning: "
          f"{res['c_full_attention_after_ft']['accuracy']:.3f}")
    return 0
