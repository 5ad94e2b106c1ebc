"""minipic-bench block-ft --model <HF folder or .gguf>: block fine-tuning of a real pretrained
model, so that its passages served as `Span`s (Block-Attention: each attends only within itself,
cached and reused at any offset) answer as well as full attention.

The task (benchmarks/block_ft_real_data.py): natural-language passages about fictional towns,
people and ships, one of which answers the question; held-out entities never occur in training.
The prompt is the model's chat format (benchmarks/block_ft_real_prompt.py). Phases:
  1. evaluate the base model through the engine on the held-out questions: spans (each passage a
     Span) and full attention (the same tokens as one plain prompt);
  2. `minipic-train` on the block layout, --ft-plain-fraction of the examples laid out plain so
     full attention does not degrade (full fine-tuning, or LoRA with --lora-rank);
  3. export (HF folder) and evaluate the export the same way.
Reports the accuracies with standard errors, the share of the full -> spans gap recovered
((spans_after - spans_before) / (full_before - spans_before)), full attention's change and the
cached share of the span runs (cached prompt tokens / prompt tokens), printed and written to
<out>/block_ft_real.json and <out>/block_ft_real.md. Goals (the issue): >= 90% recovered, full
attention loses <= 2 points.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import numpy as np

from benchmarks import block_ft_real_data as data
from benchmarks.block_ft_real_prompt import chat_segments, training_record

REPO = pathlib.Path(__file__).resolve().parents[1]
# the real recipe's values of the options block_ft_bench shares with the synthetic one
REAL_DEFAULTS = dict(batch_size=32, block_size=16, seq_len=512)
LR_FULL, LR_LORA = 5e-5, 5e-4


def add_arguments(p):
    """The options only the real-model recipe reads (block_ft_bench adds the shared ones)."""
    g = p.add_argument_group("real model (--model is an HF folder or a .gguf file)")
    g.add_argument("--steps", type=int, default=300, help="fine-tuning updates (default: %(default)s)")
    g.add_argument("--lora-rank", type=int, default=0,
                   help=f"LoRA rank; 0: full fine-tuning (default: %(default)s; default --lr "
                        f"{LR_FULL} full, {LR_LORA} LoRA)")
    g.add_argument("--eval-questions", type=int, default=400,
                   help="held-out questions (default: %(default)s)")
    g.add_argument("--train-questions", type=int, default=None,
                   help="training records (default: steps x batch size, each seen once)")
    g.add_argument("--passages", type=int, default=4,
                   help="passages per question, one answers (default: %(default)s)")
    g.add_argument("--compute-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="training compute dtype; auto: bfloat16 on a GPU, float32 on a CPU")
    g.add_argument("--eval-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="engine dtype of the evaluations (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=24,
                   help="greedy answer length in tokens (default: %(default)s)")


def is_real_model(model: str) -> bool:
    """An HF folder or a GGUF file (the synthetic recipe takes presets)."""
    path = pathlib.Path(model)
    return path.is_dir() or model.endswith(".gguf")


def resolve(args):
    """Fill the real recipe's defaults of the shared options; ValueError on bad values."""
    for name, value in REAL_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.lr is None:
        args.lr = LR_LORA if args.lora_rank else LR_FULL
    if args.train_questions is None:
        args.train_questions = args.steps * args.batch_size
    for name in ("steps", "eval_questions", "train_questions", "batch_size", "max_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.passages < 2:
        raise ValueError(f"--passages must be at least 2 (one answers, the others distract), "
                         f"got {args.passages}")
    if args.model.endswith(".gguf") and not pathlib.Path(args.model).is_file():
        raise ValueError(f"--model {args.model}: GGUF file does not exist")
    return args


def base_folder(model: str, out: pathlib.Path) -> pathlib.Path:
    """The HF folder to start from: `model` itself, or a GGUF converted once into out/base_hf by
    scripts/gguf_to_hf.py (transformers + torch + gguf; run apart, its modules stay out of
    this process)."""
    if not model.endswith(".gguf"):
        return pathlib.Path(model)
    folder = out / "base_hf"
    if not (folder / "config.json").exists():
        cmd = [sys.executable, str(REPO / "scripts" / "gguf_to_hf.py"), "--gguf", model,
               "--out", str(folder)]
        if subprocess.run(cmd).returncode != 0:
            raise ValueError(f"converting {model} to an HF folder failed (scripts/gguf_to_hf.py "
                             f"needs torch, transformers and gguf)")
    return folder


def write_train_data(path: pathlib.Path, records) -> None:
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def check_lengths(base, args, records, questions) -> int:
    """Lay every training record and held-out question out as minipic-train and the engine will
    (markers, pads, answer) and name the first that does not fit --seq-len, before any work.
    Returns the longest layout. Reads the tokenizer and config only (weights memory-mapped)."""
    from minipic_jax.loading import load_model
    from minipic_jax.training.data import layout_example, parse_record
    from minipic_jax.training.loop import engine_markers
    loaded = load_model(str(base), host=True, cache_dir=False)
    markers = engine_markers(loaded, args.block_size)
    eos = loaded.cfg.eos_token_ids[0] if loaded.cfg.eos_token_ids else None
    items = [(f"training record {i}", r) for i, r in enumerate(records)]
    items += [(f"held-out question {i}", training_record(q.passages, q.question, q.answer))
              for i, q in enumerate(questions)]
    longest = 0
    for where, rec in items:
        ex = layout_example(parse_record(rec, where), markers, loaded.tokenizer,
                            eos_token_id=eos, where=where)
        need = len(ex.tokens) + (args.max_tokens if where.startswith("held") else 0)
        if need > args.seq_len:
            raise ValueError(f"{where} lays out to {need} tokens (markers, pads, answer or "
                             f"--max-tokens), more than --seq-len {args.seq_len}; raise "
                             f"--seq-len or use fewer --passages")
        longest = max(longest, need)
    return longest


def _plain_ids(segs, tok) -> list[int]:
    """The segments as one full-attention prompt: each segment tokenized alone, as minipic-train's
    plain layout does (a leading BOS of a later segment dropped)."""
    ids = []
    for k, s in enumerate(segs):
        more = list(tok.encode(s["text"]))
        if k and more and more[0] == tok.bos_token_id:
            more = more[1:]
        ids += more
    return ids


def evaluate(llm, questions, args, *, blocks: bool) -> dict:
    """Accuracy (and its standard error) of one mode over the questions, and the cached share."""
    from minipic_jax import Prompt, SamplingParams, Span
    t0 = time.perf_counter()
    prompts = []
    for q in questions:
        segs = chat_segments(q.passages, q.question)
        prompts.append([(Span if s["kind"] == "span" else Prompt)(s["text"]) for s in segs]
                       if blocks else _plain_ids(segs, llm.get_tokenizer()))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    right = [data.correct(o.outputs[0].text, q.answer) for o, q in zip(outs, questions)]
    acc = float(np.mean(right))
    cached = sum(o.num_cached_tokens for o in outs)
    total = sum(len(o.prompt_token_ids) for o in outs)
    return {"accuracy": acc, "se": float(np.sqrt(acc * (1 - acc) / len(questions))),
            "cached_share": cached / total, "prompt_tokens": total,
            "samples": [o.outputs[0].text for o in outs[:8]], "s": time.perf_counter() - t0}


def evaluate_model(folder, questions, args) -> dict:
    """Spans first (so their cached share counts reuse among span prompts only), then full
    attention, on one engine."""
    import jax

    from minipic_jax import LLM
    t0 = time.perf_counter()
    cpu = jax.default_backend() == "cpu"
    # XLA paged attention on a CPU: the Pallas kernels run interpreted there
    llm = LLM(str(folder), dtype=args.eval_dtype, block_size=args.block_size, max_num_seqs=32,
              max_model_len=args.seq_len + 1,
              num_kv_blocks=2048, **({"attn_impl": "xla"} if cpu else {}))
    res = {"load_s": time.perf_counter() - t0}
    res["spans"] = evaluate(llm, questions, args, blocks=True)
    res["full"] = evaluate(llm, questions, args, blocks=False)
    return res


def fine_tune(args, base, train_path, out):
    """minipic-train on the block layout; returns (export folder, stats)."""
    import jax

    from minipic_jax.training import TrainConfig, Trainer
    dtype = args.compute_dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    tc = TrainConfig(model=str(base), data=str(train_path), out_dir=str(out), steps=args.steps,
                     batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                     warmup_steps=max(1, args.steps // 10), block_size=args.block_size,
                     lora_rank=args.lora_rank, plain_fraction=args.ft_plain_fraction,
                     seed=args.seed, compute_dtype=dtype, checkpoint_every=0,
                     export_dtype="float32", progress=args.progress)
    t0 = time.perf_counter()
    trainer = Trainer(tc)
    t1 = time.perf_counter()
    hist = trainer.run()
    t2 = time.perf_counter()
    folder = trainer.export()
    tail = hist[-min(20, len(hist)):]
    return folder, {"setup_s": t1 - t0, "train_s": t2 - t1, "export_s": time.perf_counter() - t2,
                    "compute_dtype": dtype, "first_loss": hist[0]["loss"],
                    "last_loss_mean20": float(np.mean([h["loss"] for h in tail]))}


def summarize(res) -> dict:
    """Gap recovered (with a first-order standard error, treating the accuracies as independent
    binomial estimates: they share questions, so an upper-side guess) and full attention's
    change."""
    (a, sa), (b, sb), (c, sc), (f, sf) = (
        (res[phase][mode]["accuracy"], res[phase][mode]["se"])
        for phase, mode in (("before", "full"), ("before", "spans"), ("after", "spans"),
                            ("after", "full")))
    out = {"full_change": f - a, "full_change_se": float(np.hypot(sa, sf)),
           "recovered": None, "recovered_se": None}
    if a > b:
        r = (c - b) / (a - b)
        out["recovered"] = r
        out["recovered_se"] = float(np.sqrt(sc ** 2 + (1 - r) ** 2 * sb ** 2 + r ** 2 * sa ** 2)
                                    / (a - b))
    out["goal_recovered"] = out["recovered"] is not None and out["recovered"] >= 0.9
    out["goal_full"] = f - a >= -0.02
    return out


def markdown(res) -> str:
    """The result table (benchmarks/RESULTS.md style)."""
    rows = ["| model | full attention | spans | cached share (spans) |", "|---|---|---|---|"]
    for phase in ("before", "after"):
        if phase in res:
            r = res[phase]
            rows.append(f"| {phase} fine-tuning | {r['full']['accuracy']:.3f} ± "
                        f"{r['full']['se']:.3f} | {r['spans']['accuracy']:.3f} ± "
                        f"{r['spans']['se']:.3f} | {r['spans']['cached_share']:.2f} |")
    s = res.get("summary")
    if s:
        rec = ("n/a (spans not below full attention before)" if s["recovered"] is None
               else f"{s['recovered']:.0%} (SE {s['recovered_se']:.0%})")
        rows += ["", f"Gap recovered: {rec} (goal >= 90%); full attention change "
                     f"{100 * s['full_change']:+.1f} points (SE {100 * s['full_change_se']:.1f}; "
                     f"goal >= -2)."]
    return "\n".join(rows) + "\n"


def prepare(args, out: pathlib.Path, res: dict):
    """Checked options, the base folder, train.jsonl and the held-out questions; every
    ValueError (a bad option, a prompt longer than --seq-len) comes from here, before any work."""
    resolve(args)
    phases = res["phases_s"]
    t0 = time.perf_counter()
    base = base_folder(args.model, out)
    phases["convert"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = [training_record(q.passages, q.question, q.answer)
               for q in data.train_questions(args.seed, args.train_questions, args.passages)]
    questions = data.held_out_questions(args.seed, args.eval_questions, args.passages)
    res["longest_layout"] = check_lengths(base, args, records, questions)
    write_train_data(out / "train.jsonl", records)
    res["train_records"] = len(records)
    phases["data"] = time.perf_counter() - t0
    return base, questions


def run(args) -> int:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "phases_s": {}}
    phases = res["phases_s"]

    def save():
        (out / "block_ft_real.json").write_text(json.dumps(res, indent=2, default=str))
        (out / "block_ft_real.md").write_text(markdown(res))

    try:
        base, questions = prepare(args, out, res)
    except ValueError as err:
        print(f"minipic-bench block-ft: error: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res["before"] = evaluate_model(base, questions, args)
    phases["eval_before"] = time.perf_counter() - t0
    save()
    print(markdown(res), flush=True)
    tuned, res["fine_tune"] = fine_tune(args, base, out / "train.jsonl", out / "run")
    phases["fine_tune"] = sum(res["fine_tune"][k] for k in ("setup_s", "train_s", "export_s"))
    t0 = time.perf_counter()
    res["after"] = evaluate_model(tuned, questions, args)
    phases["eval_after"] = time.perf_counter() - t0
    res["summary"] = summarize(res)
    save()
    print(markdown(res))
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    return 0
