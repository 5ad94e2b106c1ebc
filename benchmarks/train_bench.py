"""Block fine-tuning throughput: the training step (forward + backward + AdamW) at a ~1B Llama
shape on Block-Attention batches, as tokens/s and MFU against a bf16 matmul measured in the same
call (the anchor), for several step variants (attention implementation x remat x loss rows).

Model FLOPs per step (what MFU counts; remat's recompute is not useful work):
  6 * N_layers * tokens  +  6 * V * E * loss_rows  +  6 * 2 * layers * H * D * attended keys
(N_layers: the decoder projections; the LM head counted on the rows the loss needs, the answer
rows; the attention term counts only the keys the Block-Attention mask lets each query see, the
score and value products, forward + backward). `mfu_6n` is the usual 6 * N * tokens convention
(the LM head on every token, as the first MFU figure counted; benchmarks/RESULTS.md, Training),
for comparison.

A variant is "attn/remat/loss": attn in {xla, cudnn}, remat in {full, dots, none}, loss in
{dense (logits for every row), rows (LM head on the answer rows only)}.
"""

from __future__ import annotations

import json
import os
import time


def add_parser(p):
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=8192,
                   help="MLP intermediate size (default: %(default)s)")
    p.add_argument("--heads", type=int, default=32, help="attention heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=128256,
                   help="vocabulary size (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="examples per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=2048,
                   help="tokens per example (default: %(default)s)")
    p.add_argument("--docs", type=int, default=8, help="SSEP spans per example")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps after the compile step (median) (default: %(default)s)")
    p.add_argument("--variants", default="cudnn/none/rows,cudnn/full/rows,xla/full/dense,"
                   "cudnn/dots/rows,xla/full/rows",
                   help="comma-separated attn/remat/loss variants, run in order "
                        "(default: %(default)s)")
    p.add_argument("--peak-n", type=int, default=8192,
                   help="size of the square bf16 matmul that measures the peak (default: %(default)s)")
    p.add_argument("--time-budget", type=float, default=float("inf"),
                   help="start no variant after the first once this many seconds have passed "
                        "(default: no limit)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the cuDNN-vs-XLA correctness check")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder for train_bench.json (default: $OUT or .)")


def matmul_peak_tflops(n: int = 8192, iters: int = 10) -> float:
    import jax
    import jax.numpy as jnp
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    mm(a, b).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = mm(a, b)
    out.block_until_ready()
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def _batches(args, markers, rng):
    from minipic_jax.prompts import Prompt, Span
    from minipic_jax.training.batch import make_batch
    from minipic_jax.training.data import Record, layout_example
    budget = args.seq_len - 2 * 16 * (args.docs + 2) - 32  # room for pads, markers, answer
    doc = budget // (args.docs + 1)
    ids = lambda n: tuple(int(t) for t in rng.integers(0, min(120000, args.vocab - 8), n))
    examples = []
    for _ in range(args.batch):
        segs = (Prompt(ids(doc // 2)),) + tuple(Span(ids(doc)) for _ in range(args.docs)) + (
            Prompt(ids(doc // 2)),)
        examples.append(layout_example(Record(segs, ids(16)), markers, None, eos_token_id=None))
    return make_batch(examples, args.seq_len)


def _model_config(args):
    from configs.model_config import ModelConfig, RopeConfig
    return ModelConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_layers=args.layers,
                       num_heads=args.heads, num_kv_heads=args.kv_heads,
                       head_dim=args.hidden // args.heads, rope=RopeConfig(theta=500000.0),
                       tie_word_embeddings=True, max_position_embeddings=131072)


def parse_variant(spec: str) -> dict:
    attn, remat, loss = (spec.split("/") + ["", ""])[:3]
    if attn not in ("xla", "cudnn") or remat not in ("full", "dots", "none") or loss not in (
            "dense", "rows"):
        raise ValueError(f"variant {spec!r}: expected attn/remat/loss with attn in xla|cudnn, "
                         f"remat in full|dots|none, loss in dense|rows")
    return {"name": spec, "attn_impl": attn, "remat": remat, "loss_on": loss}


def model_flops(cfg, params, batch) -> dict:
    """Useful FLOPs of one step (see the module docstring) and the 6 * N * tokens count."""
    import jax
    import numpy as np
    valid = np.asarray(batch.valid)
    pos, win = np.asarray(batch.positions), np.asarray(batch.windows)
    attended = int(((pos - win + 1) * valid).sum())
    tokens = valid.size
    head = cfg.vocab_size * cfg.hidden_size
    n_layers = sum(int(np.prod(w.shape)) for w in jax.tree.leaves(params["layers"]) if w.ndim > 1)
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attended
    loss_rows = int(np.asarray(batch.loss_mask).sum())
    return {"flops": 6 * n_layers * tokens + 6 * head * loss_rows + attn,
            "flops_6n": 6 * (n_layers + head) * tokens + attn, "loss_rows": loss_rows}


def attention_check(seed: int = 0) -> dict:
    """cuDNN against XLA on a small Block-Attention batch: relative L2 error of the logits and of
    the gradient of a random projection of them, each against XLA in fp32 (cuDNN runs in bf16 only,
    so XLA in bf16 is given too, as the error the dtype alone costs)."""
    import argparse

    import jax
    import jax.numpy as jnp
    import numpy as np

    from minipic_jax.models import llama
    from minipic_jax.training.data import Markers
    small = argparse.Namespace(vocab=1024, hidden=256, intermediate=512, layers=2, heads=4,
                               kv_heads=2, batch=2, seq_len=512, docs=3)
    cfg = _model_config(small)
    params = llama.init_params(cfg, jax.random.key(seed), jnp.float32)
    batch = _batches(small, Markers(16, 1023, 1022, 1021), np.random.default_rng(seed))
    proj = jax.random.normal(jax.random.key(seed + 1), (small.batch, small.seq_len, cfg.vocab_size))
    valid = jnp.asarray(batch.valid)[..., None]

    def run_one(impl, dtype):
        def f(p):
            logits = llama.training_forward(p, batch.tokens, batch.positions, batch.windows,
                                            batch.valid, cfg, compute_dtype=dtype, remat=False,
                                            attn_impl=impl)
            return (logits * proj * valid).sum(), logits
        (_, logits), g = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
        return np.asarray(logits * valid), np.asarray(g["layers"][0]["wq"])

    ref = run_one("xla", jnp.float32)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    out = {}
    for impl in ("xla", "cudnn"):
        try:
            got = run_one(impl, jnp.bfloat16)
        except Exception as err:
            out[impl] = f"{type(err).__name__}: {str(err)[:300]}"
            continue
        out[impl] = {"logits_rel_err": rel(got[0], ref[0]), "grad_wq0_rel_err": rel(got[1], ref[1])}
    return out


def time_variant(v: dict, cfg, params, batch, args) -> dict:
    """Compile (first step) and time `args.steps` steps of one variant; medians in seconds."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minipic_jax.models import llama
    from minipic_jax.training.optim import make_optimizer
    from minipic_jax.training.step import make_train_step, max_loss_rows
    opt = dict(lr=1e-4, total_steps=1000, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0,
               clip_norm=1.0, grad_accum=1)
    rows = None
    if v["loss_on"] == "rows":
        rows = max_loss_rows(np.asarray(batch.loss_mask).sum(axis=1), args.batch)
    step = make_train_step(llama, cfg, tuple(sorted(opt.items())), lora_alpha=None,
                           compute_dtype=jnp.bfloat16, remat=v["remat"],
                           attn_impl=v["attn_impl"], loss_rows=rows)
    trainable = jax.tree.map(jnp.copy, params)  # the step donates its state
    state = {"trainable": trainable, "opt_state": make_optimizer(**opt).init(trainable)}
    t0 = time.perf_counter()
    state, m = step(state, None, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, None, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    del state
    return {"compile_s": compile_s, "step_s": float(np.median(times)),
            "step_s_all": [float(t) for t in times], "loss": float(m["loss"])}


def run(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minipic_jax.models import llama
    from minipic_jax.training.data import Markers

    variants = [parse_variant(s) for s in args.variants.split(",") if s]
    cfg = _model_config(args)
    t_start = time.perf_counter()
    peak = matmul_peak_tflops(args.peak_n)
    params = llama.init_params(cfg, jax.random.key(0), jnp.float32)
    n_params = sum(int(np.prod(w.shape)) for w in jax.tree.leaves(params))
    markers = Markers(block_size=16, pad_token_id=128004, ssep_token_id=128002,
                      pdep_token_id=128003)
    batch = jax.device_put(_batches(args, markers, np.random.default_rng(0)))
    fl = model_flops(cfg, params, batch)
    tokens = args.batch * args.seq_len
    res = dict(device=str(jax.devices()[0].device_kind), params=n_params, batch=args.batch,
               seq_len=args.seq_len, docs=args.docs, matmul_peak_tflops=peak, **fl, variants=[])
    os.makedirs(args.out, exist_ok=True)
    if args.check and any(v["attn_impl"] == "cudnn" for v in variants):
        res["attention_check"] = attention_check()
        print(f"attention check (bf16 vs XLA fp32, relative L2): {res['attention_check']}")
    for v in variants:
        if res["variants"] and time.perf_counter() - t_start > args.time_budget:
            print(f"{v['name']}: skipped (time budget)")
            continue
        try:
            r = {**v, **time_variant(v, cfg, params, batch, args)}
        except Exception as err:  # a variant the device cannot run must not lose the others
            r = {**v, "error": f"{type(err).__name__}: {str(err)[:400]}"}
            print(f"{v['name']}: failed: {r['error']}")
        else:
            sec = r["step_s"]
            r.update(tokens_per_s=tokens / sec, model_tflops=fl["flops"] / sec / 1e12,
                     mfu=fl["flops"] / sec / 1e12 / peak, mfu_6n=fl["flops_6n"] / sec / 1e12 / peak)
        res["variants"].append(r)
        with open(os.path.join(args.out, "train_bench.json"), "w") as f:
            json.dump(res, f, indent=2)
        jax.clear_caches()
    print(f"bf16 matmul {peak:.0f} TFLOP/s; {n_params / 1e9:.2f}B params, {tokens} tokens/step, "
          f"{fl['loss_rows']} answer rows")
    print(f"{'variant':<18}{'step ms':>9}{'tokens/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'MFU 6N':>8}"
          f"{'compile s':>10}")
    for r in res["variants"]:
        if "error" in r:
            print(f"{r['name']:<18} error: {r['error'][:60]}")
            continue
        print(f"{r['name']:<18}{r['step_s'] * 1e3:9.1f}{r['tokens_per_s']:10.0f}"
              f"{r['model_tflops']:9.0f}{r['mfu']:7.1%}{r['mfu_6n']:8.1%}{r['compile_s']:10.0f}")
    return 0
