"""Does transformers load a minipic-train export, with our logits? (needs torch + transformers)

    python scripts/check_hf_export.py --make DIR    # JAX side: a short training run on the
                                                    # tiny_llama preset, exported to DIR (fp32)
                                                    # with our logits in DIR/expected.npz
    python scripts/check_hf_export.py --check DIR   # torch side: AutoModelForCausalLM logits vs
                                                    # expected.npz; exit 1 above 1e-4

A Python with both (the device image) can pass --make and --check together.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

TOL = 1e-4
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [256, 33]]


def make(out: pathlib.Path) -> None:
    import numpy as np

    from minipic_jax.models import llama, testing
    from minipic_jax.training import TrainConfig, Trainer
    work = pathlib.Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    with open(work / "d.jsonl", "w") as f:
        for _ in range(8):
            segs = [{"kind": "prompt", "tokens": rng.integers(0, 250, 4).tolist()},
                    {"kind": "span", "tokens": rng.integers(0, 250, 9).tolist()}]
            f.write(json.dumps({"segments": segs, "answer": rng.integers(0, 250, 3).tolist()}) + "\n")
    trainer = Trainer(TrainConfig(model="tiny_llama", data=str(work / "d.jsonl"),
                                  out_dir=str(work / "run"), steps=3, batch_size=4, seq_len=64,
                                  lr=3e-3, warmup_steps=1, export_dtype="float32",
                                  progress=False))
    trainer.run()
    folder = trainer.export(out)
    logits = testing.prefill_logits(llama, trainer.params(), trainer.cfg, PROMPTS)
    np.savez(folder / "expected.npz", **{f"logits_{i}": x for i, x in enumerate(logits)})
    print(f"exported {folder}")


def check(folder: pathlib.Path) -> int:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = np.load(folder / "expected.npz")
    err = 0.0
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            got = model(torch.tensor([p])).logits[0].numpy()
            err = max(err, float(np.abs(got - want[f"logits_{i}"]).max()))
    print(f"transformers vs minipic logits on the export: max abs diff {err:.2e} (tol {TOL})")
    return 0 if err <= TOL else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make", type=pathlib.Path)
    p.add_argument("--check", type=pathlib.Path)
    args = p.parse_args()
    if args.make:
        make(args.make)
    return check(args.check) if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
