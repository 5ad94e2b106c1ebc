"""`minipic-bench cpu-vs-hf`: this engine vs HF transformers on the same CPU, same weights, same
prompts, float32, greedy, in one run.

The model is an HF folder (`--model`) or, by default, the `smollm2_135m` preset (SmolLM2-135M's
shape) with seeded random weights exported to one (speed does not depend on the weight values).
The transformers side runs in a subprocess of another interpreter (`--hf-python`: one with torch
and transformers; benchmarks/hf_generate_worker.py) that stays up for the whole run. Both sides are
pinned to the same CPUs and thread count (`--threads`: this process's affinity is cut to that many
CPUs before JAX starts, so XLA's pool sees only them; the worker takes the same CPUs and
torch.set_num_threads). Only generate calls are timed; the first call of each batch size on each
side is a warm-up, left out. Sides alternate per round (ABBA), so load drift on a shared machine
falls on both; the ratio is the median over rounds of ours / theirs. Prompts are seeded random
token ids (`--prompt-lens` range), each side makes exactly `--max-tokens` new tokens; this
engine runs without prefix caching, as each round repeats the prompts.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

DEFAULT_HF_PYTHON = "/work/venv-ref/bin/python"
WORKER = pathlib.Path(__file__).with_name("hf_generate_worker.py")


def add_parser(p) -> None:
    p.add_argument("--model", default=None,
                   help="HF folder (config.json + safetensors) both sides load; default: the "
                        "smollm2_135m preset with seeded random weights, exported to a temp folder")
    p.add_argument("--hf-python", default=os.environ.get("MINIPIC_HF_PYTHON", DEFAULT_HF_PYTHON),
                   help="interpreter with torch and transformers for the transformers side "
                        "(default $MINIPIC_HF_PYTHON or %(default)s)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="CPUs (and threads) each side is pinned to (default: all of this "
                        "process's, %(default)s)")
    p.add_argument("--batch-sizes", default="16,1", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=24, help="new tokens per prompt")
    p.add_argument("--prompt-lens", default="30,60",
                   help="min,max prompt length in tokens (seeded uniform draws)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per batch size")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    p.add_argument("--json", default=None, help="write the results to this JSON file")


def _pin(threads: int) -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(cpus):
        raise ValueError(f"--threads {threads}: this process may use {len(cpus)} CPUs")
    cpus = cpus[:threads]
    os.sched_setaffinity(0, cpus)
    return cpus


def _export_preset(seed: int, out: pathlib.Path) -> pathlib.Path:
    import jax

    from configs.presets import get_preset
    from minipic_jax.models import llama
    from minipic_jax.training.export import export_hf
    cfg = get_preset("smollm2_135m")
    return export_hf(llama.init_params(cfg, jax.random.key(seed)), cfg, llama, out)


def make_prompts(seed: int, count: int, lens: tuple[int, int], vocab: int) -> list[list[int]]:
    """`count` seeded random prompts of token ids in [3, vocab) with lengths in lens (inclusive);
    ids 0-2 are left out (pad / BOS / EOS in SmolLM2's vocabulary)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(lens[0], lens[1] + 1))).tolist()
            for _ in range(count)]


class HFWorker:
    """The transformers subprocess: one JSON line per generate call."""

    def __init__(self, python: str, folder: pathlib.Path, threads: int, cpus: list[int]):
        env = dict(os.environ, MINIPIC_CPUS=",".join(map(str, cpus)))
        self.proc = subprocess.Popen([python, str(WORKER), str(folder), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers worker exited ({self.proc.wait()}); its "
                               f"error is above")
        return json.loads(line)

    def generate(self, prompts, max_tokens: int) -> tuple[float, list]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_new_tokens": max_tokens})
                              + "\n")
        self.proc.stdin.flush()
        out = self._read()
        return out["seconds"], out["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _ours(llm, prompts, max_tokens: int) -> tuple[float, list]:
    from minipic_jax import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def _agree(a: list, b: list) -> float:
    """Share of prompts whose greedy tokens match exactly (random weights make near-ties, so
    float-order differences can flip a token; a low share means different models)."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def _throughput_line(name: str, seconds: float, prompts, max_tokens: int) -> str:
    total = sum(len(p) for p in prompts) + max_tokens * len(prompts)
    return (f"{name} Throughput: {len(prompts) / seconds:.2f} requests/s, "
            f"{total / seconds:.2f} total tokens/s, "
            f"{max_tokens * len(prompts) / seconds:.2f} output tokens/s")


def measure(llm, worker, prompts, batch: int, args) -> dict:
    """Warm-up (both sides, untimed), then `rounds` alternating timed calls of one batch size."""
    batch_prompts = prompts[:batch]
    _, ours_tokens = _ours(llm, batch_prompts, args.max_tokens)
    _, hf_tokens = worker.generate(batch_prompts, args.max_tokens)
    ours, theirs = [], []
    for r in range(args.rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for side in order:
            if side == 0:
                ours.append(_ours(llm, batch_prompts, args.max_tokens)[0])
            else:
                theirs.append(worker.generate(batch_prompts, args.max_tokens)[0])
        print(f"  batch {batch} round {r}: ours {ours[-1]:.3f} s, transformers "
              f"{theirs[-1]:.3f} s, ratio {ours[-1] / theirs[-1]:.2f}", flush=True)
    ratio = statistics.median(o / t for o, t in zip(ours, theirs))
    row = {"batch": batch, "ours_s": ours, "transformers_s": theirs, "ratio": ratio,
           "ours_median_s": statistics.median(ours), "hf_median_s": statistics.median(theirs),
           "greedy_agreement": _agree(ours_tokens, hf_tokens)}
    print(_throughput_line("ours", row["ours_median_s"], batch_prompts, args.max_tokens))
    print(_throughput_line("transformers", row["hf_median_s"], batch_prompts, args.max_tokens))
    print(f"batch {batch}: ours {row['ours_median_s']:.3f} s, transformers "
          f"{row['hf_median_s']:.3f} s, ratio ours/theirs {ratio:.2f} (median of {args.rounds}); "
          f"greedy agreement {row['greedy_agreement']:.2f}", flush=True)
    return row


def run(args) -> int:
    if not pathlib.Path(args.hf_python).exists():
        raise ValueError(f"--hf-python {args.hf_python}: no such interpreter (it needs torch "
                         f"and transformers)")
    cpus = _pin(args.threads)  # before JAX starts its thread pool
    batches = [int(b) for b in args.batch_sizes.split(",")]
    lens = tuple(int(x) for x in args.prompt_lens.split(","))
    if len(lens) != 2 or not 1 <= lens[0] <= lens[1]:
        raise ValueError(f"--prompt-lens {args.prompt_lens!r}: want MIN,MAX with 1 <= MIN <= MAX")
    with tempfile.TemporaryDirectory(prefix="cpu_vs_hf_") as tmp:
        folder = pathlib.Path(args.model) if args.model else _export_preset(
            args.seed, pathlib.Path(tmp) / "smollm2_135m")
        worker = HFWorker(args.hf_python, folder, args.threads, cpus)
        try:
            from minipic_jax import LLM
            llm = LLM(str(folder), dtype="float32", max_num_seqs=max(batches),
                      enable_prefix_caching=False)
            prompts = make_prompts(args.seed, max(batches), lens, _vocab(folder))
            print(f"cpu-vs-hf: {folder}, {args.threads} threads on CPUs {cpus}, float32, "
                  f"{args.max_tokens} new tokens, torch {worker.info.get('torch')}", flush=True)
            rows = [measure(llm, worker, prompts, b, args) for b in batches]
        finally:
            worker.close()
    result = {"model": str(args.model or "smollm2_135m (random weights)"),
              "threads": args.threads, "max_tokens": args.max_tokens, "rows": rows}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _vocab(folder: pathlib.Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    add_parser(parser)
    sys.exit(run(parser.parse_args()))
