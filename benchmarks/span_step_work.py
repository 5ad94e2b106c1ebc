"""Work of a hybrid engine's step variants at the rag bench's shapes, counted on the CPU (issue 29:
where a span step's extra cost goes).

The `qwen3_5_0_8b` widths (bf16; vocab cut to 1,024), one step of T = 1,024 rows over S = 16
sequences (rag: --max-num-batched-tokens 1024 --min-token-bucket 1024, 16 seats), rows laid out as
the rag workloads make them (a short PDEP head, then 128-token passage spans). Variants:

  plain    the step every non-span row takes (the flow pass only);
  span     a span step without a span-map pool (flow + local pass);
  warm     the span step of an engine with a span-map pool (the rag `fcfs` one): local pass, the
           transition pass over the captured pieces, the continuing captures' entries, the store;
           `caps` of its MAX_CAPTURES slots capture a span (0: the common warm step);
  compose  the chain program before a warm step (16 rows, chain length 256: span_compose.py).

Each is compiled for the CPU with the GDN kernels replaced by opaque callbacks, so
`compiled.cost_analysis()` gives the XLA work around the kernels (flops, bytes accessed); the
kernels' own work is counted from the chunks they run (`kernel_work`: the Triton pipeline's dots
and stream reads per used chunk) and the packed buffers they are handed (`packed rows`: the
static stream the XLA gathers fill, against the rows that hold tokens). `warm`'s XLA bytes include
the span-map pool's scatter, which the CPU's cost analysis counts as the whole pool (POOL_SLOTS
slots; in place on a GPU, where only the stored maps are written). Steps are built with 1
and 2 GDN layers (+ 1 attention layer); the difference is one GDN layer, and `step` extrapolates
to the model's 18.

    PYTHONPATH=. JAX_PLATFORMS=cpu python -m benchmarks.span_step_work [--json out.json]
    PYTHONPATH=. python -m benchmarks.span_step_work --time qwen3_5_0_8b --dtype bfloat16  # GPU
    ... --time ... --forms new old bv64  # each variant in each form (span_step_forms.FORMS)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_stubs import stub_pack
from benchmarks.span_step_forms import FORMS, as_form
from configs.presets import PRESETS
from minipic_jax.models import qwen3_5, qwen3_5_spans
from minipic_jax.models.testing import SimplePager
from serving.hybrid import chain_compose, span_maps, span_step
from serving.model_contract import RecurrentMetadata

PRESET, T, S, SPAN_TOKENS, CHUNK = "qwen3_5_0_8b", 1024, 16, 128, 64
POOL_SLOTS = 16  # span-map pool slots of the bench (the captures' entries gather from it)


def model_cfg(gdn_layers: int):
    base = PRESETS[PRESET]
    types = ("linear_attention",) * gdn_layers + ("full_attention",)
    return dataclasses.replace(base, vocab_size=1024, num_layers=len(types), layer_types=types)


LAYOUTS = ("spread", "long")  # --layout: rows spread over the seats, or one long prefill
LAYOUT = "spread"


def rag_rows(t: int, s: int, rng):
    """(rows per sequence, segment id per row, is-span per row) of a rag-like span step: each
    sequence's rows are a PDEP head of 0-32 rows, then SPAN_TOKENS-row spans (the last one cut
    where the sequence's rows end). LAYOUT "spread": the rows spread over the s seats; "long":
    one sequence holds t - s + 1 of them (a chunked prefill, as rag's steps at 16 seats mostly
    are), the others one row each."""
    lens = rng.multinomial(t - s, np.ones(s) / s) + 1
    if LAYOUT == "long":
        lens = np.r_[t - s + 1, np.ones(s - 1, int)]
    seg, span, base = [], [], 0
    for n in lens:
        head = int(rng.integers(0, 33)) if n > 32 else 0
        ids = np.r_[np.zeros(head, int), 1 + np.arange(n - head) // SPAN_TOKENS] if head else \
            1 + np.arange(n) // SPAN_TOKENS
        seg += (ids + base).tolist()
        span += (ids > 0).tolist()
        base += int(ids.max()) + 1
    return lens, np.asarray(seg), np.asarray(span, bool)


def step_inputs(cfg, kind: str, caps: int, t: int = T, s: int = S, seed: int = 0):
    """(metadata, logits rows, SpanPieces fields or None, RecurrentMetadata) of one step; the
    warm fields carry cap_piece / cap_slot / cap_cont as the runner fills them."""
    rng = np.random.default_rng(seed)
    lens, seg, span = rag_rows(t, s, rng)
    pager = SimplePager(s, int(lens.max()) + 8, 16, seed=0)
    md, logits_idx, _ = pager.step(lens.tolist())
    logits_idx = logits_idx[:s]  # one row per sequence, as the engine's head (the pager pads to T:
    # a 1,024-row head was the 0.70 ms cuBLAS GEMM these steps showed, s29-s31b)
    rec = RecurrentMetadata(state_slots=jnp.arange(s, dtype=jnp.int32), reset=jnp.zeros(s, bool),
                            decode=False)
    if kind == "plain":
        return md, logits_idx, None, rec
    g = span_step.piece_bound(t, s)
    pieces = qwen3_5_spans.pieces_from_segments(seg, md.num_tokens, g, span, np.zeros(s, bool))
    f = dict(row_span=pieces.row_span, piece_cu=pieces.piece_cu,
             carry_local=pieces.carry_local)
    if kind == "warm":
        cu = np.asarray(pieces.piece_cu)
        spans = [p for p in range(g) if cu[p + 1] > cu[p] and span[cu[p]]][:caps]
        cap = np.full(span_step.MAX_CAPTURES, -1, np.int32)
        cap[:len(spans)] = spans
        f.update(cap_piece=jnp.asarray(cap),
                 cap_slot=jnp.asarray(np.where(cap >= 0, np.arange(cap.size), -1), jnp.int32),
                 cap_cont=jnp.zeros(cap.size, jnp.int32))
    return md, logits_idx, f, rec


def pool(cfg, slots: int = POOL_SLOTS):
    """A zeroed span-map pool for cfg's GDN layers (bf16 conv tails, as the engine's cache)."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    lg = sum(t == "linear_attention" for t in cfg.layer_types)
    return span_maps.allocate(slots, lg, hv, dk, dv, 2 * hk * dk + hv * dv,
                              cfg.linear_conv_kernel_dim - 1, conv_dtype=jnp.bfloat16)


def step_fn(cfg, kind: str, gdn_impl: str | None = "pallas_fused_interpret"):
    """The jitted body of a step variant (the runner's, minus sampling and page zeroing)."""
    def step(params, tokens, md, cache, rec, logits_idx, f, maps):
        pieces = None if f is None else span_step.pieces(f, maps, kind == "warm", T, S)
        logits, cache, ck = qwen3_5.forward_with_checkpoints(
            params, tokens, md, cache, cfg, recurrent=rec, logits_indices=logits_idx,
            gdn_impl=gdn_impl, span_pieces=pieces)
        if kind == "warm":
            m = ck["span_maps"]
            maps = span_maps.store(maps, f["cap_slot"], m["a"], m["b"], m["tail"], m["count"])
        return logits, cache, maps
    return step


CALLS: list = []  # (static packed rows, used rows, Hv, Dk, Dv, q bytes, v bytes) per kernel call
TRANSITIONS: list = []  # (flops, bytes) of each transition scan (TRANSITIONS_IN_STREAM off)


def stub_kernels():
    """The GDN Pallas pipeline (and the stream's gather) as opaque host callbacks of the same
    shapes (benchmarks/kernel_stubs.py); each call records its stream's static and used rows."""
    from kernels_pallas.gated_delta import ragged_triton

    def packed(q, k, v, g, beta, restart, seq_of_chunk, state0, bounds, *, chunk=CHUNK, **kw):
        src = kw.get("src")  # the kernels read source rows (stream_rows.py): v is [R, Hv, Dv]
        out = v.shape if src is None else (1, src[0].shape[0]) + v.shape[1:]
        shapes = (jax.ShapeDtypeStruct(out, v.dtype),
                  jax.ShapeDtypeStruct((bounds.shape[0],) + state0.shape[1:], jnp.float32))
        static = (int(out[1]), int(out[2]), int(k.shape[-1]), int(out[3]),
                  jnp.dtype(q.dtype).itemsize, jnp.dtype(v.dtype).itemsize)
        trans = kw.get("transitions")  # the captures' products: a second scan kernel
        if trans is not None:
            shapes += (jax.ShapeDtypeStruct((trans[0].shape[0],) + state0.shape[1:2]
                                            + (static[2], static[2]), jnp.float32),)
        if getattr(state0, "write_final", False):  # the state cache, finals written in place
            shapes += (jax.ShapeDtypeStruct(state0.sources[0].shape, state0.sources[0].dtype),)

        def host(n_used, count, chunk_src):
            rows, hv, dk, dv, qb, vb = static
            used = min(int(n_used) * chunk, rows)
            own = used if chunk_src is None else chunk * int(np.sum(  # borrowed chunks: no
                np.asarray(chunk_src)[:used // chunk] == np.arange(used // chunk)))  # intra, output
            CALLS.append((rows, used, hv, dk, dv, qb, vb, own))
            if count is not None:  # its chunks' W / KD read, two dk x dk dots a chunk
                TRANSITIONS.append(transition_work(int(np.sum(count)), hv, dk, vb, chunk))
            return tuple(np.zeros(x.shape, x.dtype) for x in shapes)
        used = kw.get("n_used")
        used = jnp.int32(v.shape[1] // chunk) if used is None else used
        count = None if trans is None else trans[1]
        # the stream arrays are operands so XLA keeps the gathers that fill them
        return jax.pure_callback(lambda n, c, cs, *_: host(n, c, cs), shapes, used, count,
                                 kw.get("chunk_src"), q, k, v, g, beta, restart, seq_of_chunk,
                                 state0, bounds, src, trans)
    ragged_triton.packed_gated_delta = packed
    stub_pack()


def transition_work(chunks: int, hv: int, dk: int, vb: int, c: int = CHUNK):
    """(flops, bytes) of the transition scan (ragged_triton._transition_kernel) over `chunks`
    chunks: per chunk and head W P and KD^T V' (dk x dk products), W and KD read."""
    return chunks * hv * 4 * c * dk * dk, chunks * c * hv * 2 * dk * vb


def kernel_work(rows: int, hv: int, dk: int, dv: int, qb: int, vb: int, c: int = CHUNK,
                own: int | None = None):
    """(flops, bytes) of the Triton pipeline over `rows` packed rows (rows / c chunks), of which
    `own` (None: all) read their own W / U / KD (the others borrow a lender's: joint.py): per
    chunk and head the scan's dots (W s, KD^T V') over every row, the intra-chunk (k k^T, w, u)
    and output (q s, q k^T, attn V') ones over own rows; bytes: the scan reads w / u / kd and
    writes V' and each chunk's entering state; the rest (own rows) reads the stream (q, k twice,
    v, g, beta), writes w / u / kd, reads V' and the states, writes the output (dot dtype: v's)."""
    own = rows if own is None else own
    chunks, own_chunks = rows // c, own // c
    flops = (chunks * hv * 4 * c * dk * dv
             + own_chunks * hv * (2 * c * c * (3 * dk + 2 * dv) + 2 * c * dk * dv))
    scan_row = hv * ((2 * dk + dv) * vb + dv * vb)
    own_row = hv * (3 * dk * qb + dv * vb + 8 + (2 * dk + dv) * vb + 2 * dv * vb)
    state = hv * dk * dv * vb
    return flops, rows * scan_row + chunks * state + own * own_row + own_chunks * state


def measure(gdn_layers: int, kind: str, caps: int = 0) -> dict:
    """One step variant with `gdn_layers` GDN layers: XLA flops / bytes outside the kernels
    (cost_analysis of the CPU-compiled step), and the kernel calls' packed and used rows."""
    cfg = model_cfg(gdn_layers)
    md, logits_idx, f, rec = step_inputs(cfg, kind, caps)
    params = qwen3_5.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    cache = qwen3_5.init_cache(cfg, S * 80, 16, S, jnp.bfloat16)
    maps = pool(cfg) if kind == "warm" else None
    args = (params, jnp.zeros(md.num_tokens, jnp.int32), md, cache, rec, logits_idx, f, maps)
    # the cache and the span-map pool donated, as the runner's step (written in place)
    compiled = jax.jit(step_fn(cfg, kind), donate_argnums=(3, 7)).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    CALLS.clear()
    TRANSITIONS.clear()
    jax.block_until_ready(compiled(*args))
    calls = list(CALLS)
    kernel = [kernel_work(c[1], *c[2:7], own=c[7]) for c in calls] + TRANSITIONS
    return dict(xla_flops=float(cost.get("flops", 0.0)),
                xla_bytes=float(cost.get("bytes accessed", 0.0)),
                packed_rows=sum(c[0] for c in calls), used_rows=sum(c[1] for c in calls),
                own_rows=sum(c[7] for c in calls),
                kernel_flops=float(sum(k[0] for k in kernel)),
                kernel_bytes=float(sum(k[1] for k in kernel)), kernel_calls=len(calls),
                real_rows=int(md.cu_q_lens[-1]),
                span_rows=0 if f is None else int(np.asarray(f["row_span"]).sum()))


def variant(kind: str, caps: int = 0, gdn_layers: int = 18) -> dict:
    """Per GDN layer (2 layers minus 1) and the step extrapolated to `gdn_layers`."""
    one, two = measure(1, kind, caps), measure(2, kind, caps)
    keys = [k for k in one if k not in ("real_rows", "span_rows")]
    per = {k: two[k] - one[k] for k in keys}
    step = {k: one[k] + (gdn_layers - 1) * per[k] for k in keys}
    return dict(kind=kind, caps=caps, rows=one["real_rows"], span_rows=one["span_rows"],
                per_gdn_layer=per, step=step)


def compose_work(rows: int = 16, maps_per_row: int = 4, gdn_layers: int = 18) -> dict:
    """The chain program's map applications for `rows` rows of `maps_per_row` cached spans each
    (serving/hybrid/chain_compose.py's plan), its GFLOP and the bytes of one read of each
    applied map (A and B in float32: the floor of any form; the XLA loop makes ~12 map-sized
    passes per application, docs/DESIGN.md section 5)."""
    cfg = PRESETS[PRESET]
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    apps = chain_compose.applications([maps_per_row] * rows, rows)
    per = chain_compose.flops_per_application(gdn_layers, hv, dk, dv)
    return dict(rows=rows, maps=rows * maps_per_row, applications=apps, flops=float(apps * per),
                bytes=float(apps * gdn_layers * hv * dk * (dk + dv) * 4))


def time_variant(kind: str, caps: int, preset: str, dtype, reps: int = 7,
                 profile_top: int = 0):
    """Median ms of one step of `kind` on this backend, the whole preset with its real GDN path (the
    engine's choice on this backend; no stubs), the cache and pool fed back as the runner does.
    Returns (ms, None), or with profile_top (ms, benchmarks.timing.profile_kernels of 3 more
    steps, that many kernels)."""
    cfg = PRESETS[preset]
    md, logits_idx, f, rec = step_inputs(cfg, kind, caps)
    # fused projections, as the engine's (Config.fuse_weights): unfused, the timed steps held 66
    # wrapped_concatenate kernels (~0.6 ms; H100, session 36), as many as XLA merging the dots
    # that share an input by concatenating their weights every step would make
    params = qwen3_5.fuse_params(qwen3_5.init_params(cfg, jax.random.key(0), dtype))
    cache, maps = qwen3_5.init_cache(cfg, S * 80, 16, S, dtype), None
    if kind == "warm":
        maps = pool(cfg)
    fn = jax.jit(step_fn(cfg, kind, None), donate_argnums=(3, 7))
    tokens = jnp.zeros(md.num_tokens, jnp.int32)
    times = []
    for _ in range(reps + 1):  # the first call compiles
        t0 = time.perf_counter()
        _, cache, maps = jax.block_until_ready(fn(params, tokens, md, cache, rec, logits_idx, f,
                                                  maps))
        times.append(1e3 * (time.perf_counter() - t0))
    if not profile_top:
        return float(np.median(times[1:])), None
    from benchmarks.timing import profile_kernels
    state = [cache, maps]

    def call():
        out = fn(params, tokens, md, state[0], rec, logits_idx, f, state[1])
        state[:] = out[1:]
        return out
    return float(np.median(times[1:])), profile_kernels(call, top=profile_top)


def table(rows: list[dict]) -> list[str]:
    """The bench's lines: per variant the step's rows and span rows, flops and bytes (XLA +
    kernels), both per computed token (step row), and the packed rows the kernels are handed
    against those that hold tokens (used) and those whose chunks are their own (the others'
    intra-chunk and output work is their lender's: joint.py's borrowed chunks)."""
    head = (f"{'variant':>16} {'rows':>5} {'span':>5} {'GFLOP xla':>10} {'GFLOP kern':>10} "
            f"{'GB xla':>7} {'GB kern':>7} {'MFLOP/tok':>9} {'GB/1k tok':>9} "
            f"{'packed rows':>11} {'used':>7} {'own':>7}  (step, 18 GDN layers)")
    out = [head]
    for r in rows:
        st = r["step"]
        if r["kind"] == "compose":
            out.append(f"{'compose':>16} {r['rows']:5d} {r['maps']:5d} {st['flops'] / 1e9:10.2f} "
                       f"{'-':>10} {st['bytes'] / 1e9:7.3f}  ({r['applications']} applications)")
            continue
        tokens = r["rows"]  # the prompt tokens the step computes (span rows run twice)
        flops = st["xla_flops"] + st["kernel_flops"]
        gb = (st["xla_bytes"] + st["kernel_bytes"]) / 1e9
        name = r["kind"] + (f"/{r['caps']}" if r["kind"] == "warm" else "")
        if r.get("form", "new") != "new":
            name += f" {r['form']}"
        out.append(f"{name:>16} {r['rows']:5d} {r['span_rows']:5d} {st['xla_flops'] / 1e9:10.2f} "
                   f"{st['kernel_flops'] / 1e9:10.2f} {st['xla_bytes'] / 1e9:7.3f} "
                   f"{st['kernel_bytes'] / 1e9:7.3f} {flops / tokens / 1e6:9.2f} "
                   f"{gb / tokens * 1e3:9.3f} {int(st['packed_rows']):11d} "
                   f"{int(st['used_rows']):7d} {int(st.get('own_rows', st['used_rows'])):7d}")
    return out


def main(argv=None):
    global LAYOUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["plain", "span", "warm/0", "warm/4"],
                    help="plain, span, warm/N (N captures), compose (default: %(default)s)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--time", default=None, metavar="PRESET",
                    help="instead: CPU ms per step of each variant on this preset (float32, "
                         "its real GDN path), e.g. tiny_qwen3_5")
    ap.add_argument("--reps", type=int, default=7, help="--time: steps timed (median)")
    ap.add_argument("--forms", nargs="+", default=["new"], choices=sorted(FORMS),
                    help="each variant in these forms, one after the other (FORMS; %(default)s)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="--time on a GPU: also trace 3 steps of each variant and print its N "
                         "costliest kernels (benchmarks.timing.profile_kernels)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="--time: the model's dtype (bfloat16 on a GPU) (%(default)s)")
    ap.add_argument("--layout", default="spread", choices=LAYOUTS,
                    help="the step's rows over its seats (rag_rows; %(default)s)")
    args = ap.parse_args(argv)
    LAYOUT = args.layout
    if args.time:
        for v in args.variants:
            kind, _, caps = v.partition("/")
            for form in args.forms:
                with as_form(form):
                    ms, prof = time_variant(kind, int(caps or 0), args.time,
                                            jnp.dtype(args.dtype), args.reps, args.profile)
                print(f"time {args.time} {args.dtype} {v:8s} {form:11s} T={T} S={S}: "
                      f"{ms:.2f} ms/step", flush=True)
                if prof is not None:
                    print(f"profile {v} {form}: {prof['kernels_per_step']:.0f} kernels, busy "
                          f"{prof['kernel_busy_ms_per_step']:.2f} ms, first-to-last "
                          f"{prof['first_to_last_kernel_ms_per_step']:.2f} ms per step")
                    for k in prof["top"]:
                        print(f"profile {v} {form} | {k['ms_per_step']:7.3f} ms | "
                              f"{k['calls_per_step']:5.1f} | {k['name']}", flush=True)
        return
    stub_kernels()
    rows = []
    for v in args.variants:
        if v == "compose":
            c = compose_work()
            rows.append(dict(kind="compose", rows=c["rows"], maps=c["maps"],
                             applications=c["applications"], step=c))
            continue
        kind, _, caps = v.partition("/")
        for form in args.forms:
            with as_form(form):
                rows.append(dict(variant(kind, int(caps or 0)), form=form))
            print(table(rows)[-1], flush=True)
    print("\n".join(table(rows)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
