"""minipic-train: block-attention fine-tuning from a JSONL file, then an HF export.

    minipic-train --model PATH_OR_PRESET --data train.jsonl --out runs/x --steps 200 \
        --batch-size 8 --seq-len 1024 --lr 1e-4 [--lora-rank 16] [--plain-fraction 0.5]

Re-running the same command after a crash resumes from the newest checkpoint in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from minipic_jax.training.loop import TrainConfig, train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minipic-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder, cached repo id or preset")
    p.add_argument("--data", required=True, help="JSONL: {segments: [...], answer: ...} per line")
    p.add_argument("--out", required=True, help="run folder (checkpoints, metrics, export)")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("model", "data", "out_dir"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str}[str(f.type)]
            p.add_argument(flag, type=kind, default=f.default)
    return p


def main(argv=None) -> int:
    args = vars(build_parser().parse_args(argv))
    args["out_dir"] = args.pop("out")
    try:
        folder = train(TrainConfig(**args))
    except ValueError as err:
        print(f"minipic-train: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
