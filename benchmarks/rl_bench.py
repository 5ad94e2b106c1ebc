"""`minipic-bench rl`: a GRPO-style RL loop with the engine doing the rollouts
(benchmarks/rl_loop.py), its reward curve (PNG) and time split; with `--update-timing` /
`--rollout-compare` the GPU measurements of benchmarks/rl_measure.py instead.

    minipic-bench rl --model tiny_llama                   # CPU: about 3 minutes
    minipic-bench rl --model <SmolLM2-135M-Instruct folder> --task add --dtype bfloat16
    minipic-bench rl --update-timing --model llama3_8b --dtype bfloat16
    minipic-bench rl --update-timing --model llama3_8b --dtype bfloat16 --tensor-parallel 2
    minipic-bench rl --rollout-compare --model llama3_2_1b --dtype bfloat16
    minipic-bench rl --rollout-compare --rollout-prompts 16 --model llama3_8b --dtype bfloat16
"""

from __future__ import annotations

import json
import pathlib

from benchmarks import rl_task


def add_parser(p) -> None:
    p.add_argument("--model", default="tiny_llama",
                   help="any model LLM takes: preset, HF folder or GGUF (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="params and compute dtype of engine and trainer (default: %(default)s)")
    p.add_argument("--task", default="next_letter", choices=rl_task.TASKS,
                   help="the verifiable task, benchmarks/rl_task.py (default: %(default)s)")
    p.add_argument("--steps", type=int, default=150,
                   help="GRPO steps: rollouts, rewards, one optax update (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=16,
                   help="prompts per step (B) (default: %(default)s)")
    p.add_argument("--samples", type=int, default=8,
                   help="samples per prompt (G, SamplingParams.n) (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=4,
                   help="tokens sampled per completion (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds prompts, sampling and init (default: %(default)s)")
    p.add_argument("--out-dir", default="benchmarks/runs",
                   help="rl_reward.png, rl_run.json (rl_measure.json) here (default: %(default)s)")
    p.add_argument("--update-timing", action="store_true",
                   help="time LLM.update_weights at the model's shape (e.g. llama3_8b, bf16)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="--update-timing: devices the engine is split over "
                        "(tensor_parallel_size; the weight sets arrive placed by its rules "
                        "table, memory per device) (default: %(default)s)")
    p.add_argument("--rollout-compare", action="store_true",
                   help="G (--samples) samples of B (--rollout-prompts) 512-token prompts, 256 "
                        "new tokens: engine vs a plain jitted sampling loop (dense KV, no "
                        "sharing), each decode step against the weight-read floor")
    p.add_argument("--rollout-prompts", type=int, default=1,
                   help="--rollout-compare: prompts (B), each sampled --samples times "
                        "(default: %(default)s)")
    p.add_argument("--rollout-prompt-len", type=int, default=512,
                   help="--rollout-compare: tokens per prompt (default: %(default)s)")
    p.add_argument("--rollout-new-tokens", type=int, default=256,
                   help="--rollout-compare: tokens sampled per rollout (default: %(default)s)")
    p.add_argument("--copy-gb", type=float, default=4.0,
                   help="--rollout-compare: GiB of the copy that measures the device's copy "
                        "rate (the weight-read floor; as engine_bench) (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool in blocks of the measuring engines (default: 256 for "
                        "--update-timing; for --rollout-compare what the rollouts need plus a "
                        "quarter, so the plain loop fits beside it)")


def _plot(history, path: pathlib.Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return False
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["reward"] for h in history], label="mean reward")
    ax.plot(steps, [h["accuracy"] for h in history], label="accuracy (reward 1)")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _time_split(history) -> dict:
    """Seconds per phase summed over the steps after the first (which compiles), and shares."""
    rows = history[1:] or history
    split = {k: sum(h[k] for h in rows) for k in ("rollout_s", "score_s", "train_s", "update_s")}
    total = sum(split.values()) or 1.0
    return {**split, **{k.replace("_s", "_share"): v / total for k, v in split.items()}}


def _rollout_compare(args, extra: dict) -> dict:
    """The engine batches every rollout (B x G seats); a bounded pool (the B prompts' blocks,
    shared, and each rollout's own, plus a quarter): the plain loop's weights and dense caches
    must fit beside it."""
    from benchmarks import rl_measure
    b, g, bs = args.rollout_prompts, args.samples, 16
    plen, new = args.rollout_prompt_len, args.rollout_new_tokens
    blocks = b * -(-plen // bs) + b * g * (-(-new // bs) + 1)
    return rl_measure.rollout_compare(
        args.model, args.dtype, prompts=b, samples=g, prompt_len=plen, new_tokens=new,
        copy_gb=args.copy_gb, max_num_seqs=b * g, max_model_len=plen + new + bs, block_size=bs,
        **({"num_kv_blocks": max(blocks * 5 // 4, 64)} | extra))


def run(args) -> int:
    from benchmarks import rl_measure
    from benchmarks.rl_loop import RLConfig, run_loop
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    if args.update_timing or args.rollout_compare:
        result = {}
        if args.update_timing:
            result["update_timing"] = rl_measure.update_timing(
                args.model, args.dtype, max_num_seqs=8, max_model_len=1024,
                tensor_parallel_size=args.tensor_parallel, **({"num_kv_blocks": 256} | extra))
        if args.rollout_compare:
            result["rollout_compare"] = _rollout_compare(args, extra)
        (out_dir / "rl_measure.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {out_dir / 'rl_measure.json'}")
        return 0
    rc = RLConfig(task=args.task, steps=args.steps, prompts_per_step=args.prompts,
                  samples=args.samples, max_tokens=args.max_tokens, lr=args.lr, seed=args.seed)
    history = run_loop(args.model, rc, dtype=args.dtype, max_num_seqs=args.prompts * args.samples,
                       max_model_len=128, block_size=16,
                       max_num_batched_tokens=max(512, 16 * args.prompts), **extra)
    split = _time_split(history)
    print("time split (steps after the first): " + ", ".join(
        f"{k[:-2]} {split[k]:.2f}s ({split[k[:-2] + '_share']:.0%})"
        for k in ("rollout_s", "score_s", "train_s", "update_s")))
    tenth = max(len(history) // 10, 1)
    first = sum(h["reward"] for h in history[:tenth]) / tenth
    last = sum(h["reward"] for h in history[-tenth:]) / tenth
    print(f"reward: first {tenth} steps {first:.3f} -> last {tenth} steps {last:.3f}")
    png = out_dir / "rl_reward.png"
    title = f"GRPO on {args.task}, {args.model}, B={args.prompts} G={args.samples}"
    if _plot(history, png, title):
        print(f"wrote {png}")
    (out_dir / "rl_run.json").write_text(json.dumps(
        dict(config=rc.__dict__, model=args.model, dtype=args.dtype, history=history,
             time_split=split, reward_first=first, reward_last=last), indent=1))
    return 0
