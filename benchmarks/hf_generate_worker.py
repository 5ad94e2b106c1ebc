"""The transformers side of `minipic-bench cpu-vs-hf` (benchmarks/cpu_vs_hf.py), run as a script
by another interpreter (one with torch; it imports nothing of this project and no JAX).

    python hf_generate_worker.py MODEL_FOLDER THREADS

It loads the folder in float32, pins itself to THREADS CPUs (the ones the parent passes in
MINIPIC_CPUS, else the first THREADS) and torch to THREADS threads, then answers one JSON line
per request line on stdin: {"prompts": [[ids]...], "max_new_tokens": N} -> {"seconds": s,
"tokens": [[ids]...]}, timing only `generate` (greedy, left-padded batch, exactly N new
tokens). An empty line or EOF ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    folder, threads = sys.argv[1], int(sys.argv[2])
    cpus = [int(c) for c in os.environ.get("MINIPIC_CPUS", "").split(",") if c]
    os.sched_setaffinity(0, cpus or sorted(os.sched_getaffinity(0))[:threads])
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    pad = 0
    print(json.dumps({"ready": True, "torch": torch.__version__,
                      "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        prompts, new = req["prompts"], int(req["max_new_tokens"])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=pad)
            seconds = time.perf_counter() - t0
        tokens = out[:, width:].tolist()
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
