"""`minipic run-batch`'s command line: its options (each with help and default, every number
checked by minipic_jax.cli_args.py) and the checks of its paths, all made before the model is
built."""

from __future__ import annotations

import argparse
import os

from minipic_jax.cli_args import (DefaultsFormatter, int_at_least, non_negative_float,
                                  positive_float, positive_int, seed_int)

DESCRIPTION = """An offline job over a JSONL file in the OpenAI batch format (as `vllm run-batch`):
one request per line, one result or error record per line in the output, written as each
finishes. A rerun of the same command resumes: requests the output file already answers are
skipped (--retry-errors answers the error records' lines again). Ctrl-C stops the job; rerun to
resume."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minipic run-batch", description=DESCRIPTION,
                                 formatter_class=DefaultsFormatter)
    ap.add_argument("-i", "--input-file", required=True,
                    help="JSONL requests, one {custom_id, method, url, body} per line")
    ap.add_argument("-o", "--output-file", required=True,
                    help="JSONL results, appended (must not be the input file)")
    ap.add_argument("--retry-errors", action="store_true",
                    help="drop the output file's error records first, so their lines are "
                         "answered again (after fixing them, or a transient failure)")
    ap.add_argument("--model", default="tiny-llama3",
                    help="preset name (configs/presets.py) or HF model folder")
    ap.add_argument("--served-model-name", default=None,
                    help="'model' in the responses (default: --model, unless the request names one)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="weights and KV cache dtype")
    ap.add_argument("--seed", type=seed_int, default=0,
                    help="preset weights and the per-request seeds of sampled requests without one")
    ap.add_argument("--max-model-len", type=positive_int, default=None,
                    help="longest prompt + output in tokens (default: the model's, at most 2048; "
                         "a smaller one makes the CPU attention fallback much cheaper)")
    ap.add_argument("--max-num-seqs", type=positive_int, default=64,
                    help="sequences per engine step")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                    help="query tokens per engine step (>= --max-num-seqs)")
    ap.add_argument("--min-token-bucket", type=positive_int, default=None,
                    help="smallest step size in tokens (steps are padded to powers of two; "
                         "default: the engine's, 1 on a CPU backend and 8 elsewhere)")
    ap.add_argument("--block-size", type=positive_int, default=16,
                    help="tokens per KV block (a power of two)")
    ap.add_argument("--num-kv-blocks", type=int_at_least(2), default=None,
                    help="KV pool size in blocks (default: from the device's free memory)")
    ap.add_argument("--kv-mode", default="position_free",
                    choices=("position_free", "rotated", "pic_off"),
                    help="position_free = MiniPIC span reuse; rotated = classic prefix caching; "
                         "pic_off = position-free keys, markers as plain text")
    ap.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "barrier", "isps"),
                    help="admission order (serving/config.py)")
    ap.add_argument("--cpu-offload-gb", type=non_negative_float, default=0.0,
                    help="host memory for KV blocks evicted from the device")
    ap.add_argument("--kv-store-dir", default=None,
                    help="persistent span store folder, shared by jobs and processes (default: off)")
    ap.add_argument("--kv-store-gb", type=positive_float, default=64.0,
                    help="span store size; least recently used runs are deleted past it")
    ap.add_argument("--kv-store-spans-only", action="store_true",
                    help="store SSEP span blocks only (not questions or other prompt parts)")
    ap.add_argument("--kv-store-staging-gb", type=positive_float, default=None,
                    help="device memory for store runs read ahead of their copy-in (default: "
                         "min(16 GiB, 16%% of the device's memory))")
    ap.add_argument("--kv-store-pinned", action="store_true",
                    help="read store runs into pinned host buffers (Config.kv_store.pinned)")
    ap.add_argument("--max-inflight", type=positive_int, default=None,
                    help="requests in the engine at once (default: 4 x --max-num-seqs)")
    ap.add_argument("--warmup", action="store_true",
                    help="compile every step variant before the first request (a progress bar "
                         "counts them) instead of each one when first needed")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--output-json", default=None, help="write the job's stats here (JSON)")
    return ap


def engine_args(args) -> dict:
    out = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               min_token_bucket=args.min_token_bucket,
               block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_mode=args.kv_mode,
               scheduling_policy=args.scheduling_policy, cpu_offload_gb=args.cpu_offload_gb,
               kv_store_dir=args.kv_store_dir, kv_store_gb=args.kv_store_gb,
               kv_store_spans_only=args.kv_store_spans_only,
               kv_store_staging_gb=args.kv_store_staging_gb,
               kv_store_pinned=args.kv_store_pinned)
    if args.max_model_len is not None:
        out["max_model_len"] = args.max_model_len
    return out


def _writable_file(path: str, what: str) -> None:
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a folder, not a file")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{what} {path!r}: folder {parent!r} does not exist")


def check_paths(args) -> None:
    """ValueError/OSError naming the path: an input that is missing, a folder or unreadable; an
    output (or --output-json) that is a folder, in a missing folder, or the input file itself
    (also through a symbolic or hard link: resuming would read its own results as requests)."""
    inp, out = args.input_file, args.output_file
    if not os.path.exists(inp):
        raise ValueError(f"input file {inp!r} does not exist")
    if os.path.isdir(inp):
        raise ValueError(f"input file {inp!r} is a folder, not a file")
    with open(inp, "rb"):  # unreadable: PermissionError, named by main
        pass
    _writable_file(out, "output file")
    if os.path.exists(out) and os.path.samefile(inp, out) or \
            os.path.realpath(inp) == os.path.realpath(out):
        raise ValueError(f"output file {out!r} is the input file {inp!r}; write the results "
                         f"to another file")
    if args.output_json is not None:
        _writable_file(args.output_json, "--output-json")
