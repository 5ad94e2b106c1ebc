"""`minipic-bench engine --breakdown`: where the decode step's device time goes.

Runs after the engine bench's decode measurement, on the same engine (batch B, context C, random
K/V, the runner's last decode inputs), in the same process. Each variant is the runner's jitted
step (or a piece of it) timed two ways: `blocked` = median of calls each waited for (what the
bench's "jitted step alone" measures: host dispatch latency included) and `pipelined` = N calls
issued back to back, then one wait (device throughput).

Stage removal (bench-only stand-ins patched into the Llama module while the variant traces):
  step             the engine's decode step as is (fused weights when the runner fused them)
  step_unfused     same, separate Q/K/V and gate/up weights
  step_1blk        same, one context block per sequence (what is not K/V reading)
  no_attention     attention replaced by its query (K/V write kept)
  no_attn_write    attention and K/V write removed (K/V projections kept alive)
  gemm_chain       only the weight GEMMs, residual adds and the lm_head + argmax
  weights_read     every weight a step reads, summed (one reduction per array): the achievable
                   read rate of these arrays, kernel launches included
  lm_head_sample   final norm + lm_head + the sampler (greedy)
  sample_*         the sampler alone on [B, V] float32 logits
plus a jax.profiler trace of three decode steps summarised on the device (top kernels).
"""

from __future__ import annotations

import contextlib
import functools
import time

from benchmarks.timing import profile_kernels


def _timed(call, n: int = 10) -> dict:
    """call() -> array to wait on. Returns blocked / pipelined ms."""
    import jax

    from benchmarks.timing import blocked_ms
    blocked = blocked_ms(call, n)["ms"]
    t = time.perf_counter()
    outs = [call() for _ in range(n)]
    jax.block_until_ready(outs)
    return {"blocked_ms": blocked, "pipelined_ms": (time.perf_counter() - t) / n * 1e3}


@contextlib.contextmanager
def _patched(module, **attrs):
    old = {k: getattr(module, k) for k in attrs}
    for k, v in attrs.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _standins():
    """Attention -> its query; write -> nothing, with K + V folded into the next query so the
    K/V projections stay live."""
    import jax.numpy as jnp
    held = {}

    def write(k_pages, v_pages, k, v, slot_mapping, **_):
        held["kv"] = k + v
        return k_pages, v_pages

    def attend(q, k_pages, v_pages, metadata, inv_freq, **_):
        kv = held.pop("kv", None)
        if kv is not None:
            q = q + jnp.repeat(kv, q.shape[1] // kv.shape[1], axis=1)
        return q

    return write, attend


def _unfuse(params, cfg):
    import jax

    from minipic_jax.models import llama
    del cfg
    return jax.jit(llama.unfuse_params)(params)


def _gemm_chain(params, x, cfg):
    """Weight GEMMs + residual adds + lm_head + argmax, nothing else."""
    import jax
    import jax.numpy as jnp

    h, k, f = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    for lp in params["layers"]:
        if "wqkv" in lp:
            qkv = jnp.einsum("te,end->tnd", x, lp["wqkv"])
            q = qkv[:, :h] + jnp.repeat(qkv[:, h:h + k] + qkv[:, h + k:], h // k, axis=1)
            x = x + jnp.einsum("thd,hde->te", q, lp["wo"])
            gu = jnp.einsum("te,ef->tf", x, lp["w_gate_up"])
            x = x + jnp.einsum("tf,fe->te", jax.nn.silu(gu[:, :f]) * gu[:, f:], lp["w_down"])
        else:
            q = jnp.einsum("te,ehd->thd", x, lp["wq"])
            kv = jnp.einsum("te,ekd->tkd", x, lp["wk"]) + jnp.einsum("te,ekd->tkd", x, lp["wv"])
            q = q + jnp.repeat(kv, h // k, axis=1)
            x = x + jnp.einsum("thd,hde->te", q, lp["wo"])
            g = jnp.einsum("te,ef->tf", x, lp["w_gate"])
            u = jnp.einsum("te,ef->tf", x, lp["w_up"])
            x = x + jnp.einsum("tf,fe->te", jax.nn.silu(g) * u, lp["w_down"])
    head = params["embed"].T if "lm_head" not in params else params["lm_head"]
    logits = jnp.einsum("ne,ev->nv", x, head, preferred_element_type=jnp.float32)
    return jnp.argmax(logits, axis=-1)


def _sample_old(logits):
    """The sampler's greedy path before this change (full [S, V] log_softmax, then a gather)."""
    import jax
    import jax.numpy as jnp
    logp = jax.nn.log_softmax(logits, axis=-1)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def one_block_inputs(runner, ints, kw):
    """The runner's packed step inputs with one context block per sequence, each query attending
    to its own position only: the same step minus (almost all) K/V reading."""
    import numpy as np

    from serving.step.step_inputs import layout
    spec, _ = layout(kw["t"], kw["s"], runner.nb, block_size=runner.block_size)
    short = ints.copy()
    o, (n,) = spec["num_blocks"]
    short[o:o + n] = np.minimum(short[o:o + n], 1)
    o, (n,) = spec["q_window_start"]
    op, _ = spec["q_positions"]
    short[o:o + n] = short[op:op + n]
    return short


def run_breakdown(engine, args) -> dict:
    """All variants on the primed engine (its runner's last inputs are a batch x ctx decode)."""
    import jax

    r = engine.runner
    ints, floats, kw = r.last_inputs
    res, state = {}, {"cache": r.cache}
    statics = ("t", "s", "all_greedy", "use_filter", "num_logprobs", "decode_only")

    def fresh_step():  # a new jit of the runner's step (traced under the current patches)
        return jax.jit(functools.partial(r._step_impl), donate_argnums=(1,),
                       static_argnames=statics)

    # the engine's own step variant: in async mode decode tokens come from the device-side
    # last sampled tokens (`prev`), as in ModelRunner
    prev = (r.prev_tokens,) if r.prev_tokens is not None else ()

    def stepper(fn, params, ii):
        def call():
            # the engine's arguments past the cache (prev tokens, pools, device block tables)
            rest = r._args(ii, floats, bool(prev), kw)[2:]
            result = fn(params, state["cache"], *rest, **kw)
            state["cache"], out = result[0], result[1]
            if rest[5] is not None:  # the tables the step returns (donated by r._step)
                r.dev_tables.keep(result[5])
            return out
        return call

    def record(name, timing, note=""):
        res[name] = dict(timing, note=note)
        print(f"  {name:18s} blocked {timing['blocked_ms']:7.2f} ms  pipelined "
              f"{timing['pipelined_ms']:7.2f} ms  {note}", flush=True)

    fused = any("wqkv" in lp for lp in r.params["layers"])
    print(f"breakdown (batch {args.batch}, ctx {args.ctx}, runner weights "
          f"{'fused' if fused else 'unfused'}):", flush=True)
    lite = getattr(args, "breakdown", "full") == "lite"
    _stage_rows(record, stepper, fresh_step, r, one_block_inputs(r, ints, kw), fused, lite)
    if not lite:
        _sampler_rows(record, r, kw["s"])
    r.cache = state["cache"]
    if lite:
        return res
    _profile_rows(res, stepper(r._step, r.params, ints))
    r.cache = state["cache"]
    return res


def _stage_rows(record, stepper, fresh_step, r, short, fused: bool, lite: bool):
    """The step as is, with one context block, unfused, without attention (and write), the
    weight GEMM chain alone and the weight read rate."""
    import jax
    import jax.numpy as jnp

    from minipic_jax.models import paged_cache
    ints, cfg = r.last_inputs[0], r.mcfg
    record("step", _timed(stepper(r._step, r.params, ints)))
    record("step_1blk", _timed(stepper(r._step, r.params, short)))
    unfused = _unfuse(r.params, cfg) if fused and not lite else r.params
    if fused and not lite:
        plain = fresh_step()
        record("step_unfused", _timed(stepper(plain, unfused, ints)))
        record("step_unfused_1blk", _timed(stepper(plain, unfused, short)))
    if not lite:  # the models reach the kernels through paged_cache.write_and_attend
        write, attend = _standins()
        with _patched(paged_cache, paged_attention=attend):
            record("no_attention", _timed(stepper(fresh_step(), r.params, ints)),
                   "attention -> q, K/V write kept")
        write, attend = _standins()
        with _patched(paged_cache, paged_attention=attend, write_kv=write):
            record("no_attn_write", _timed(stepper(fresh_step(), r.params, ints)),
                   "attention and K/V write removed")
    x = _hidden(r)
    chain = jax.jit(functools.partial(_gemm_chain, cfg=cfg))
    record("gemm_chain", _timed(lambda: chain(r.params, x)), "weight GEMMs + lm_head only")
    if fused and not lite:
        record("gemm_chain_unfused", _timed(lambda: chain(unfused, x)))
    del unfused
    read = [w for w in jax.tree.leaves(r.params) if w is not r.params["embed"] or
            "lm_head" not in r.params]
    nbytes = sum(w.nbytes for w in read)
    summed = jax.jit(lambda ws: sum(jnp.sum(w, dtype=jnp.float32) for w in ws))
    t = _timed(lambda: summed(read))
    record("weights_read", t, f"{nbytes / 1e9:.2f} GB at {nbytes / t['pipelined_ms'] / 1e9:.2f} "
                              f"TB/s (pipelined)")


def _hidden(r):
    """Random hidden states [S, E] of the step's sequences, in the weights' dtype."""
    import jax
    s = r.last_inputs[2]["s"]
    return (0.5 * jax.random.normal(jax.random.key(3), (s, r.mcfg.hidden_size))).astype(
        r.params["embed"].dtype)


def _sampler_rows(record, r, s: int):
    """Final norm + lm_head + sampler, and the sampler alone in each mode, on [S, V] logits."""
    import jax
    import jax.numpy as jnp

    from minipic_jax.models import layers
    from serving.step import sampler as smp
    cfg, x = r.mcfg, _hidden(r)
    head = r.params["embed"].T if "lm_head" not in r.params else r.params["lm_head"]
    sm = smp.SamplingMetadata(
        temperature=jnp.full((s,), 0.8), top_k=jnp.full((s,), 50, jnp.int32),
        top_p=jnp.full((s,), 0.9), seed=jnp.arange(s, dtype=jnp.uint32),
        step=jnp.zeros((s,), jnp.int32))

    def head_fn(x, head, final_norm, old):
        h = layers.rms_norm(x, final_norm, cfg.rms_norm_eps)
        logits = layers.logits_from_hidden(h, head)
        if old:
            return _sample_old(logits)
        return smp.sample(logits, sm, all_greedy=True, use_filter=False, num_logprobs=0)

    hf = jax.jit(head_fn, static_argnames="old")
    record("lm_head_sample", _timed(lambda: hf(x, head, r.params["final_norm"], False)))
    record("lm_head_sample_old", _timed(lambda: hf(x, head, r.params["final_norm"], True)),
           "previous greedy path (full log_softmax)")
    logits = jax.random.normal(jax.random.key(4), (s, cfg.vocab_size), jnp.float32) * 3
    modes = {"greedy": (True, False, 0), "temperature": (False, False, 0),
             "top_k_top_p": (False, True, 0), "logprobs20": (True, False, 20)}
    for name, (g, f, lp) in modes.items():
        fn = jax.jit(functools.partial(smp.sample, all_greedy=g, use_filter=f, num_logprobs=lp))
        record(f"sample_{name}", _timed(lambda fn=fn: fn(logits, sm)))
    old = jax.jit(_sample_old)
    record("sample_greedy_old", _timed(lambda: old(logits)))


def _profile_rows(res: dict, step):
    """A jax.profiler trace of the decode step, summarised into res["profile"]."""
    try:
        prof = profile_kernels(step)
        res["profile"] = prof
        print("profile lines: " + "; ".join(f"{k} {v['events']} ev {v['ms']:.1f} ms"
                                            for k, v in prof["lines"].items()))
        print(f"profile: {prof['kernels_per_step']:.0f} kernels/step, busy "
              f"{prof['kernel_busy_ms_per_step']:.2f} ms of "
              f"{prof['first_to_last_kernel_ms_per_step']:.2f} ms first-to-last kernel", flush=True)
        for row in prof["top"]:
            print(f"    {row['ms_per_step']:7.3f} ms  x{row['calls_per_step']:5.0f}  {row['name']}")
    except Exception as e:  # noqa: BLE001 - the timings above stand without the trace
        res["profile_error"] = repr(e)
        print(f"profile failed: {e!r}", flush=True)
