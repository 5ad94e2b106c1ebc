"""Block fine-tuning throughput: the training step (forward + backward + AdamW) at a ~1B Llama
shape on Block-Attention batches, as tokens/s and MFU against a bf16 matmul measured in the same
call (the anchor).

Model FLOPs per step (what MFU counts; remat's recompute is not useful work):
  6 * N_matmul * tokens  +  6 * 2 * layers * H * D * sum over rows of attended keys
(N_matmul: every projection and the LM head; the attention term counts only the keys the
Block-Attention mask lets each query see, the score and value products, forward + backward).
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
    p.add_argument("--attn-impl", default=None, help="jax.nn.dot_product_attention impl")
    p.add_argument("--no-remat", action="store_true", help="disable rematerialisation (remat)")
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


def run(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from configs.model_config import ModelConfig, RopeConfig
    from minipic_jax.models import llama
    from minipic_jax.training.data import Markers
    from minipic_jax.training.optim import make_optimizer
    from minipic_jax.training.step import make_train_step

    cfg = ModelConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads, rope=RopeConfig(theta=500000.0),
                      tie_word_embeddings=True, max_position_embeddings=131072)
    peak = matmul_peak_tflops()
    params = llama.init_params(cfg, jax.random.key(0), jnp.float32)
    n_params = sum(int(np.prod(w.shape)) for w in jax.tree.leaves(params))
    opt = dict(lr=1e-4, total_steps=1000, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0,
               clip_norm=1.0, grad_accum=1)
    tx = make_optimizer(**opt)
    step = make_train_step(llama, cfg, tuple(sorted(opt.items())), lora_alpha=None,
                           compute_dtype=jnp.bfloat16, remat=not args.no_remat,
                           attn_impl=args.attn_impl)
    state = {"trainable": params, "opt_state": tx.init(params)}
    markers = Markers(block_size=16, pad_token_id=128004, ssep_token_id=128002,
                      pdep_token_id=128003)
    batch = jax.device_put(_batches(args, markers, np.random.default_rng(0)))
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
    sec = float(np.median(times))
    tokens = args.batch * args.seq_len
    valid = np.asarray(batch.valid)
    pos, win = np.asarray(batch.positions), np.asarray(batch.windows)
    attended = sum(int(((pos[b] - win[b] + 1) * valid[b]).sum()) for b in range(args.batch))
    n_matmul = n_params - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    flops = 6 * n_matmul * tokens + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attended
    res = dict(device=str(jax.devices()[0].device_kind), params=n_params, batch=args.batch,
               seq_len=args.seq_len, docs=args.docs, remat=not args.no_remat,
               attn_impl=args.attn_impl, compile_s=compile_s, step_s=sec,
               tokens_per_s=tokens / sec, model_tflops=flops / sec / 1e12,
               matmul_peak_tflops=peak, mfu=flops / sec / 1e12 / peak, loss=float(m["loss"]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_bench.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"train step {sec * 1e3:.1f} ms, {res['tokens_per_s']:.0f} tokens/s, "
          f"{res['model_tflops']:.0f} TFLOP/s = MFU {res['mfu']:.1%} of the measured bf16 matmul "
          f"{peak:.0f} TFLOP/s ({n_params / 1e9:.2f}B params, compile {compile_s:.0f} s)")
    return 0
