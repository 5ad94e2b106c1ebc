"""minipic-train: block-attention fine-tuning from a JSONL file, then an HF export.

    minipic-train --model PATH_OR_PRESET --data train.jsonl --out runs/x --steps 200 \
        --batch-size 8 --seq-len 1024 --lr 1e-4 [--lora-rank 16] [--plain-fraction 0.5]

Re-running the same command after a crash resumes from the newest checkpoint in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from minipic_jax.cli_args import (DefaultsFormatter, non_negative_float, non_negative_int,
                                  positive_float, positive_int, seed_int)
from minipic_jax.training.loop import TrainConfig, train


# every TrainConfig field's flag: (type check, help); numbers are checked before any work
HELP = {
    "steps": (positive_int, "optimizer updates"),
    "batch_size": (positive_int, "examples per micro-step"),
    "grad_accum": (positive_int, "micro-steps per update"),
    "seq_len": (positive_int, "tokens per example (right-padded to it)"),
    "lr": (positive_float, "peak learning rate (AdamW)"),
    "warmup_steps": (non_negative_int, "linear warm-up updates"),
    "min_lr_ratio": (non_negative_float, "cosine decay floor, as a fraction of --lr"),
    "weight_decay": (non_negative_float, "AdamW weight decay"),
    "clip_norm": (non_negative_float, "global gradient-norm clip (0: none)"),
    "lora_rank": (non_negative_int, "LoRA rank (0: full fine-tuning)"),
    "lora_alpha": (positive_float, "LoRA alpha (scale alpha / rank)"),
    "plain_fraction": (non_negative_float, "share of examples laid out without blocks (full "
                                           "attention), in [0, 1]"),
    "block_size": (positive_int, "the engine block_size the model will be served with"),
    "compute_dtype": (str, "dtype of the forward/backward (master weights are float32)"),
    "remat": (str, "rematerialization: dots (projection outputs kept), full (least memory) "
                   "or none"),
    "attn_impl": (str, "attention: auto (cuDNN on a GPU in bf16), xla or cudnn"),
    "seed": (seed_int, "data order, LoRA init and preset weights"),
    "checkpoint_every": (non_negative_int, "updates between checkpoints (0: only at the end)"),
    "export_dtype": (str, "dtype of the exported HF weights"),
    "progress": (None, "progress bar"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minipic-train", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsFormatter)
    p.add_argument("--model", required=True, help="HF folder, cached repo id or preset")
    p.add_argument("--data", required=True, help="JSONL: {segments: [...], answer: ...} per line")
    p.add_argument("--out", required=True, help="run folder (checkpoints, metrics, export); "
                                                "rerunning with the same folder resumes")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("model", "data", "out_dir"):
            continue
        flag = "--" + f.name.replace("_", "-")
        kind, text = HELP[f.name]
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                           help=text)
        else:
            p.add_argument(flag, type=kind, default=f.default, help=text)
    return p


def main(argv=None) -> int:
    args = vars(build_parser().parse_args(argv))
    args["out_dir"] = args.pop("out")
    try:
        folder = train(TrainConfig(**args))
    except (ValueError, OSError) as err:
        print(f"minipic-train: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nminipic-train: interrupted; rerun the same command to resume from the newest "
              "checkpoint in --out", file=sys.stderr)
        return 130
    print(f"exported {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
