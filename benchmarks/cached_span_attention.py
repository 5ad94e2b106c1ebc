"""The cached-span step's attention call alone (issue 14), old vs new in one process.

The engine's step (benchmarks/rag_ttft.py cached_step_profile): one sequence of `new` query rows
in a `tokens`-row bucket over `spans` x `span_tokens` cached position-free keys, two prefill
slots (one dead), the decode part left out, block table permuted and as wide as max_model_len.
Each variant of implementation="mixed" is checked against the first one's output (--reference:
the float64 numpy reference, about a minute of host time), timed
interleaved (ABBA) and profiled per kernel; the table gives ms per call, the gather's and the
attention kernel's share, and GB/s of one read of K and V (the floor) over each.

  PYTHONPATH=. python3 -m benchmarks.cached_span_attention [--variants old,direct_v,dv+idle,paged_k]

(paged_k's PagedOptions sweep: the pk:* variants, PAGED.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

# MixedOptions fields over the base, both spelled out (unset, both are on: mixed_defaults)
VARIANTS = {"old": {"direct_v": False, "skip_idle": False},
            "direct_v": {"direct_v": True, "skip_idle": False},
            "dv+idle": {"direct_v": True, "skip_idle": True},
            "idle": {"direct_v": False, "skip_idle": True},
            # no pre-pass: K and V from the pages, keys rotated in the kernel (issue 28 item 2)
            "paged_k": {"direct_v": True, "skip_idle": True, "paged_k": True}}
# paged_k with mosaic_prefill_paged.PagedOptions fields (the sweep of issue 28 item 2), spelled
# out; "paged_k" alone is PagedOptions' defaults (pk:pf1's fields)
_ORDER = {"v_first": False, "prefetch": 0}
PAGED = {"pk:v1": {"cos_sin": "pages", **_ORDER},  # the first version, measured 1.41x
         "pk:keys": {"cos_sin": "keys", **_ORDER},  # cos | sin per key: one box, no big table
         "pk:vfirst": {"cos_sin": "keys", "v_first": True, "prefetch": 0},
         "pk:pf1": {"cos_sin": "keys", "v_first": False, "prefetch": 1},  # L2 prefetch
         "pk:vf_pf1": {"cos_sin": "keys", "v_first": True, "prefetch": 1},
         "pk:pf2": {"cos_sin": "keys", "v_first": False, "prefetch": 2},
         # a fourth warpgroup rotates (registers: compute, memory, rotator): the memory
         # warpgroup never waits for a landing
         "pk:rot": {"rotator": (208, 24, 72)},
         "pk:rot200": {"rotator": (200, 40, 72)},
         "pk:rot_pk": {"rotator": (208, 24, 72), "packed": True},
         "pk:packed": {"packed": True},  # rotation in bf16x2 math
         "pk:r200": {"registers": (200, 112)},  # more registers for the rotating warpgroup
         # timing only: keys read as stored (kv_mode "rotated"), no rotation and no cos | sin:
         # the rotation's share of the time (its error against the others is meaningless)
         "pk:norot": {"kv_mode": "rotated"}}
VARIANTS.update({n: {**VARIANTS["paged_k"], "paged": f} for n, f in PAGED.items()})


@dataclasses.dataclass(frozen=True)
class Shape:
    new: int = 72
    tokens: int = 128
    spans: int = 8
    span_tokens: int = 4096
    max_model_len: int = 33792
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16


def inputs(shape: Shape, seed: int):
    """(q [tokens, H, D], k, v pages, metadata, inv_freq): sequence 0 holds the query rows at
    positions cached..cached+new-1 over its cached keys; sequence row 1 is empty."""
    import jax
    import jax.numpy as jnp
    from kernels_pallas.paged_attention.metadata import AttentionMetadata
    from kernels_pallas.paged_attention.random_inputs import inv_freq_for
    s, rng = shape, np.random.default_rng(seed)
    cached = s.spans * s.span_tokens
    total = cached + s.new
    blocks = -(-total // s.page_size)
    width = s.max_model_len // s.page_size
    num_pages = blocks + 64
    table = np.zeros((2, width), np.int32)
    table[0, :blocks] = rng.permutation(num_pages)[:blocks]
    valid = np.zeros((2, width), np.int32)
    valid[0, :blocks] = s.page_size
    valid[0, blocks - 1] = total - (blocks - 1) * s.page_size
    pos = np.zeros(s.tokens, np.int32)
    pos[: s.new] = np.arange(cached, total)
    q_seq = np.full(s.tokens, 1, np.int32)
    q_seq[: s.new] = 0
    md = AttentionMetadata(
        q_positions=jnp.asarray(pos), q_window_start=jnp.zeros((s.tokens,), jnp.int32),
        q_seq=jnp.asarray(q_seq), cu_q_lens=jnp.asarray([0, s.new, s.new], jnp.int32),
        num_blocks=jnp.asarray([blocks, 0], jnp.int32), block_tables=jnp.asarray(table),
        block_pos_start=jnp.asarray(np.tile(np.arange(width, dtype=np.int32) * s.page_size,
                                            (2, 1))),
        block_num_valid=jnp.asarray(valid), slot_mapping=jnp.full((s.tokens,), -1, jnp.int32))
    pages = (num_pages, s.page_size, s.kv_heads, s.head_dim)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)  # on device: 70M values
    q = jax.random.normal(kq, (s.tokens, s.heads, s.head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, pages, jnp.bfloat16)
    v = jax.random.normal(kv, pages, jnp.bfloat16)
    return q, k, v, md, jnp.asarray(inv_freq_for(s.head_dim, None))


def attention_call(extra: dict, args):
    """The variant's jitted call, compiled (run once on `args`). A "paged" entry holds
    PagedOptions fields: MixedOptions has only paged_k (on / off), so the first call, which
    traces, runs with mosaic_mixed's PagedOptions replaced by one with those defaults; later
    calls reuse that trace (same shapes), so the timed calls carry no patch. api._run_once (a
    jit keyed on MixedOptions, the same for every pk:* variant) forgets its traces first, and a
    variant whose options were never built fails rather than time another variant's kernel."""
    from unittest import mock

    import jax
    from kernels_pallas.paged_attention import api, mosaic_mixed
    extra = dict(extra)
    fields = dict(extra.pop("paged", {}))
    kv_mode = fields.pop("kv_mode", "position_free")
    options = dict(prefill_seqs=2, prefill_fits=True, decode_rows=False, **extra)
    fn = jax.jit(lambda q, k, v, md, inv: api.paged_attention(
        q, k, v, md, inv, kv_mode=kv_mode, implementation="mixed", kernel_options=options))
    built = []
    base = mosaic_mixed.PagedOptions

    def paged(**kw):
        built.append(base(**{**kw, **fields}))
        return built[-1]

    api._run_once.clear_cache()
    with mock.patch.object(mosaic_mixed, "PagedOptions", paged):
        jax.block_until_ready(fn(*args))
    if extra.get("paged_k") and not built:
        raise RuntimeError(f"paged variant {fields}: its PagedOptions were never built (a "
                           "cached trace?)")
    return fn


def _kernel_ms(prof: dict, name: str) -> float:
    return sum(r["ms_per_step"] for r in prof["top"] if name in r["name"])


def main(argv=None) -> int:
    import jax
    from benchmarks.timing import ab_time, profile_kernels
    from kernels_pallas.paged_attention.reference import paged_attention_reference
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="old,direct_v,dv+idle")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", action="store_true",
                    help="error against the float64 numpy reference (~1 min of host time); "
                         "default: against the first variant's output")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cached_span.json"))
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    shape = Shape()
    q, k, v, md, inv = inputs(shape, args.seed)
    ref = None
    if args.reference:
        ref = paged_attention_reference(q, k, v, md, inv, kv_mode="position_free")[: shape.new]
    kv_bytes = 2 * (shape.spans * shape.span_tokens + shape.new) * shape.kv_heads * shape.head_dim * 2
    print(f"cached-span attention: {shape.new} rows over {shape.spans}x{shape.span_tokens} "
          f"keys, H{shape.heads}/K{shape.kv_heads} D{shape.head_dim}; K+V once = "
          f"{kv_bytes / 1e6:.1f} MB; kernel times by profile, GB/s = K+V once / busy time; "
          f"rel err vs {'the float64 reference' if ref is not None else names[0]}")
    print(f"{'variant':<10} {'busy ms':>8} {'gather':>8} {'kernel':>8} {'rest':>8} {'GB/s':>6} "
          f"{'rel err':>9}   (rest: the XLA glue, e.g. cos | sin rows)", flush=True)
    rows = {}
    fns = {}
    for n in names:  # each row printed when measured: a variant that hangs loses only itself
        print(f"compiling {n}", flush=True)  # (ptxas reports, when dumped, follow this line)
        try:  # one variant that does not compile costs only its own row
            fn = fns[n] = attention_call(VARIANTS[n], (q, k, v, md, inv))
        except Exception as e:  # noqa: BLE001 (printed, the sweep goes on)
            print(f"{n:<10} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        out = jax.block_until_ready(fn(q, k, v, md, inv))
        out = np.asarray(out.astype(np.float32), np.float64)[: shape.new]
        ref = out if ref is None else ref  # the first variant's, unless --reference
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        prof = profile_kernels(lambda fn=fn: fn(q, k, v, md, inv), steps=5)
        r = rows[n] = dict(rel_err=err, busy_ms=prof["kernel_busy_ms_per_step"],
                           gather_ms=_kernel_ms(prof, "gather_live"),
                           # "anonymous_" or, with paged keys (bound kernel), "wrapped_"
                           attn_kernel_ms=_kernel_ms(prof, "mosaic_gpu_kernel"),
                           top=prof["top"][:8])
        rest = r["busy_ms"] - r["gather_ms"] - r["attn_kernel_ms"]
        print(f"{n:<10} {r['busy_ms']:8.4f} {r['gather_ms']:8.4f} {r['attn_kernel_ms']:8.4f} "
              f"{rest:8.4f} {kv_bytes / r['busy_ms'] / 1e6:6.0f} {err:9.2e}", flush=True)
        base = names[0]  # timed against the first variant now: a sweep cut short keeps these
        if n != base and base in fns:
            ma, mb, med, lo, hi = ab_time(fns[base], fn, q, k, v, md, inv, iters=args.iters,
                                          reps=args.reps)
            r.update(wall_ms=mb, base_wall_ms=ma, ratio=med, ratio_iqr=(lo, hi))
            print(f"  A/B wall per call (interleaved): {base} {ma:.4f} ms, {n} {mb:.4f} ms, "
                  f"ratio {med:.3f} [IQR {lo:.3f}-{hi:.3f}]", flush=True)
        with open(args.out, "w") as f:  # after every variant: a sweep cut short keeps its rows
            json.dump(dict(shape=dataclasses.asdict(shape), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
