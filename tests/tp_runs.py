"""Subprocess half of tests/test_tensor_parallel.py (not a test module: it needs
XLA_FLAGS=--xla_force_host_platform_device_count set before JAX starts, which the test does).

    python -m tests.tp_runs FIXTURE TP[,TP...] [--errors] [--checkpoints] [--stream]
        [--cached] [--gdn] [--hybrid]
        -> one JSON line

For each tensor_parallel_size: greedy generation with logprobs over the fixture's HF prompts
and a few structured prompts that repeat SSEP spans (prefix-cache hits, position-free KV);
plus the parameter / KV-pool shardings and the collectives in the compiled step.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np

from minipic_jax import LLM, Prompt, SamplingParams, Span, build_prompt
from tests.conftest import FIXTURES

MAX_TOKENS = 6


def _prompts(llm, ref) -> list:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, 20).tolist() for _ in range(2)]
    structured = [build_prompt([Prompt([1, 2, 3]), Span(docs[i % 2]), Span(docs[(i + 1) % 2]),
                                Prompt(rng.integers(0, 250, 3).tolist())], block_size=16,
                               **llm.llm_engine.markers) for i in range(3)]
    hf = [ref[k].tolist() for k in sorted(ref.files) if k.startswith("prompt_")]
    return hf, structured


def run(name: str, tp: int) -> dict:
    ref = np.load(FIXTURES / name / "reference.npz")
    llm = LLM(str(FIXTURES / name), warmup=False, dtype="float32", seed=0, max_num_seqs=4,
              max_num_batched_tokens=32, min_token_bucket=32, max_model_len=192, block_size=16,
              num_kv_blocks=64, tensor_parallel_size=tp)
    hf, structured = _prompts(llm, ref)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    outs = llm.generate(hf + structured, sp, use_tqdm=False)
    runner = llm.llm_engine.runner
    hlo = ""
    if tp > 1:  # the last step's executable, as the run compiled it, for its text (TP=1 has
        # no collectives; not compiled again: CI time)
        ints, floats, kw = runner.last_inputs
        args = runner._args(ints, floats, llm.config.async_scheduling, kw)  # as _dispatch
        step = runner._step  # serving/step/step_executables.py: its table of compiled variants
        args += step._defaults[len(args):]  # as StepExecutables.__call__
        hlo = step._table[step._key(args, kw)].as_text()
    kv = runner.cache.k[0]
    tables = runner.dev_tables.array  # the device block tables (serving/step/resident_tables.py)
    return {
        "tables_equal": bool(np.array_equal(np.asarray(tables), runner.tables.stack)),
        "tables_replicated": bool(tables.sharding.is_fully_replicated),
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                     for o in outs],
        "hf_greedy": [ref[f"greedy_{i}"].tolist()[:MAX_TOKENS] for i in range(len(hf))],
        "cached": [o.num_cached_tokens for o in outs[len(hf):]],
        "prompts": hf + structured,  # for the float64 reference (tests/tp_precision.py)
        "markers": llm.llm_engine.markers,
        "kv_spec": [str(a) for a in kv.sharding.spec] if tp > 1 else [],
        "kv_shard_shape": list(kv.sharding.shard_shape(kv.shape)),
        "kv_shape": list(kv.shape),
        "all_reduces": len(re.findall(r" all-reduce\(", hlo)),
        "all_gather_shapes": re.findall(r"= (\S+) all-gather\(", hlo),
    }


def cached(name: str, tp: int) -> dict:
    """Prefix caching with a host tier (cpu_offload_gb) on a small pool: a 100-token system
    prompt is computed once, unrelated traffic pushes its KV blocks (and, on a hybrid, its
    recurrent checkpoints) out of the device pool to host memory, and later requests resume
    from them. Tokens, logprobs, cached tokens and the tier counters (to compare with TP=1)."""
    hybrid = name.startswith("qwen")
    # host tier: 16 blocks of 4 KiB (a 16-token block's K and V in the GQA and Qwen3.5
    # fixtures; 8 blocks in MHA's) and, on the hybrid, 8 checkpoints of 5376 bytes (3 GDN
    # layers' conv and delta states); the device tier holds 2 checkpoints
    ckpt = 5376
    extra = dict(checkpoint_gb=2 * ckpt / 2**30, checkpoints_per_prompt=2) if hybrid else {}
    llm = LLM(str(FIXTURES / name), warmup=False, dtype="float32", seed=0, max_num_seqs=2,
              max_num_batched_tokens=32, min_token_bucket=32, max_model_len=192, block_size=16,
              num_kv_blocks=24, cpu_offload_gb=(16 * 4096 + 8 * ckpt) / 2**30,
              tensor_parallel_size=tp, **extra)
    rng = np.random.default_rng(1)
    system = rng.integers(0, 250, 100).tolist()
    prompts = [system + rng.integers(0, 250, n).tolist() for n in (9, 21, 30)]
    flood = [rng.integers(0, 250, 150).tolist() for _ in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outs = []
    for batch in ([prompts[0]], flood, prompts[1:]):
        outs += llm.generate(batch, sp, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    keys = ("blocks_offloaded", "blocks_restored", "checkpoint_hits", "tokens_resumed",
            "checkpoints_offloaded", "checkpoints_onloaded")
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                         o.outputs[0].token_ids)] for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "stats": {k: stats[k] for k in keys if k in stats}}


def _placement(runner) -> dict:
    """Per state array (the cache, the checkpoint and span-map pools): whether it is where the
    rules table places it (nothing without a mesh)."""
    import jax

    from serving.hybrid import checkpoint_pool, span_maps
    from serving.step import sharding
    if runner.mesh is None:
        return {}
    axes, out = runner.family.cache_axes(runner.mcfg), {}
    for name, tree, tree_axes in (("cache", runner.cache, axes),
                                  ("ck_pool", runner.ck_pool, checkpoint_pool.pool_axes(axes)),
                                  ("span_pool", runner.span_pool, span_maps.pool_axes(axes))):
        target = jax.tree.leaves(sharding.shardings(tree, tree_axes, runner.mesh))
        for (path, x), want in zip(jax.tree_util.tree_leaves_with_path(tree), target):
            out[name + jax.tree_util.keystr(path)] = x.sharding.is_equivalent_to(want, x.ndim)
    return out


def _hybrid_llm(tp: int, **kw):
    """The small Qwen3.5 engine of `hybrid` (one compiled step variant: the 32-token bucket)."""
    return LLM(str(FIXTURES / "qwen3_5_gva2"), warmup=False, dtype="float32", seed=0,
               max_num_seqs=4, num_kv_blocks=64, max_num_batched_tokens=32, min_token_bucket=32,
               max_model_len=192, tensor_parallel_size=tp, **kw)


def _hybrid_requests(llm) -> list:
    """Two requests, then one sharing the second's first 64 tokens (a prefix-cache hit that
    restores the recurrent checkpoint at 64): their outputs."""
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    long = list(range(10, 80))
    outs = llm.generate([list(range(1, 8)), long], sp, use_tqdm=False)
    return outs + llm.generate([long[:64] + [3, 1, 4, 1, 5]], sp, use_tqdm=False)


def _tokens_and_logprobs(outs) -> dict:
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                         o.outputs[0].token_ids)] for o in outs]}


def hybrid(tp: int) -> dict:
    """`_hybrid_requests` on `_hybrid_llm`: tokens, logprobs, cached tokens, checkpoint hits,
    and whether the cache and the recurrent pools are where the rules table places them before
    the first step and after the last; a failing step is reported as its error (the other runs
    of the subprocess go on)."""
    try:
        llm = _hybrid_llm(tp)
        first = _placement(llm.llm_engine.runner)
        outs = _hybrid_requests(llm)
    except Exception as err:  # noqa: BLE001 - the test names it
        return {"error": f"{type(err).__name__}: {err}"[:1500]}
    return {**_tokens_and_logprobs(outs), "cached": [o.num_cached_tokens for o in outs],
            "checkpoint_hits": llm.llm_engine.get_stats().get("checkpoint_hits"),
            "placed_first": first, "placed_last": _placement(llm.llm_engine.runner),
            "collectives": _collectives(llm.llm_engine.runner)}


def hybrid_in_place(tp: int) -> dict:
    """`hybrid`'s requests with the GDN decode stepped in place (qwen3_5.GDN_DECODE_IN_PLACE,
    with the layer's glue; the conv form does not run under TP): decode-only steps of their own
    (decode_attn_impl), the GDN kernels interpreted, each layer's decode kernel per head shard
    (kernels_pallas/sharding.ragged_decode_layer_in_place). Tokens, logprobs and how many times
    the kernel was traced."""
    from kernels_pallas.gated_delta import decode_rows as api  # where the kernel is called
    from minipic_jax.models import qwen3_5
    calls, kernel, was = [], api.decode_layer_in_place, qwen3_5.GDN_DECODE_IN_PLACE
    api.decode_layer_in_place = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    qwen3_5.GDN_DECODE_IN_PLACE = True
    try:
        llm = _hybrid_llm(tp, decode_attn_impl="triton_decode", step_cache="off")
        llm.llm_engine.runner.gdn_impl = "pallas_fused_interpret"
        outs = _hybrid_requests(llm)
    except Exception as err:  # noqa: BLE001 - the test names it
        return {"error": f"{type(err).__name__}: {err}"[:1500]}
    finally:
        qwen3_5.GDN_DECODE_IN_PLACE, api.decode_layer_in_place = was, kernel
    return {**_tokens_and_logprobs(outs), "kernel_calls": len(calls)}


def _collectives(runner) -> dict:
    """Per compiled step variant (as the engine compiled it: no compile here), its all-reduce
    count and all-gather shapes."""
    out = {}
    for key, exe in runner._step._table.items():
        hlo = exe.as_text()
        out[repr(key[0][:2])] = {"all_reduces": len(re.findall(r" all-reduce\(", hlo)),
                                 "all_gathers": re.findall(r"= (\S+) all-gather\(", hlo)}
    return out


def checkpoints(name: str, tp: int) -> dict:
    """A hybrid's recurrent checkpoints (forward_with_checkpoints at chunk-aligned positions of
    the fixture's 150-token prompt) and final states, placed as the engine places them."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from minipic_jax.loading import load_model
    from minipic_jax.models import testing
    from serving.step import sharding
    lm = load_model(str(FIXTURES / name))
    prompt = np.load(FIXTURES / name / "reference.npz")["prompt_2"].astype(np.int32)
    pager = testing.SimplePager(1, len(prompt) + 8, 16, seed=1)
    cfg, mesh = lm.cfg, None
    if tp > 1:  # as the engine places them
        mesh, cfg = sharding.place_model(lm, tp)
    params = lm.params

    def make():
        return lm.family.init_cache(cfg, pager.num_pages, 16, 1, jnp.float32)
    cache = make() if mesh is None else sharding.init_sharded(make, lm.family.cache_axes(cfg),
                                                              mesh)
    md, _, total = pager.step([len(prompt)])
    tokens = np.zeros(md.num_tokens, np.int32)
    tokens[:total] = prompt

    def fwd(params, tokens, md, cache, ck):
        ctx = (contextlib.nullcontext() if mesh is None
               else jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        with ctx:
            return lm.family.forward_with_checkpoints(params, tokens, md, cache, cfg,
                                                      checkpoint_at=ck)
    _, cache, cks = jax.jit(fwd)(params, jnp.asarray(tokens), md, cache,
                                 jnp.asarray([[64, 128]], jnp.int32))
    return {"ck_delta": np.asarray(cks["delta"]).tolist(),
            "ck_conv": np.asarray(cks["conv"]).tolist(),
            "final_delta": np.stack([np.asarray(d[0]) for d in cache.delta]).tolist()}


def stream(name: str) -> dict:
    """Streamed loading (load_model(host=True) + place_model) vs the old path (params loaded on
    one device, then moved): per TP size, whether every param is equal with the same sharding.
    Then a checkpoint of larger tensors streamed onto devices 2-3: per tensor placed, the host
    bytes numpy allocated at the peak beyond what it held before (tracemalloc; on CPU devices
    the placed arrays may alias their host slices, so they count as held), and what devices
    0-1 (the default device, where the old path loads the whole model) gained."""
    import dataclasses
    import pathlib
    import tempfile
    import tracemalloc

    import jax
    import safetensors.numpy
    from jax.sharding import Mesh

    from minipic_jax.loading import load_model
    from minipic_jax.loading.safetensors_io import SafetensorsReader
    from minipic_jax.models import llama_hf
    from serving.step import sharding
    out = {"equal": {}}
    for tp in (2, 4):
        old, new = (load_model(str(FIXTURES / name), cache_dir=False),
                    load_model(str(FIXTURES / name), host=True))
        _, cfg_old = sharding.place_model(old, tp)
        _, cfg_new = sharding.place_model(new, tp, np.float32)
        same = [a.sharding == b.sharding and np.array_equal(a, b)
                for a, b in zip(jax.tree.leaves(old.params), jax.tree.leaves(new.params))]
        out["equal"][tp] = cfg_old == cfg_new and len(same) > 0 and all(same)
    lm = load_model(str(FIXTURES / name), cache_dir=False)  # its config, wider
    cfg = dataclasses.replace(lm.cfg, hidden_size=256, vocab_size=4096, intermediate_size=512,
                              head_dim=64)
    del old, new, lm.params

    def on_default():  # array id -> (the array, bytes it holds on devices 0-1; not read: no
        # new arrays). The array is kept: an id is an address, and an array freed while a
        # snapshot is compared would lend its id to a new one (counted as old: flaky).
        return {id(a): (a, sum(d.id < 2 for d in a.sharding.device_set) * a.dtype.itemsize *
                        int(np.prod(a.sharding.shard_shape(a.shape)))) for a in jax.live_arrays()}

    def new_bytes(before, after):
        return sum(n for i, (_, n) in after.items() if i not in before)
    staged, gained, make = [], [], jax.make_array_from_callback

    def measured(*args):  # stream_params' one call per tensor
        dev = on_default()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        arr = make(*args)
        staged.append(tracemalloc.get_traced_memory()[1] - held)
        gained.append(new_bytes(dev, on_default()))
        return arr
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "model.safetensors"
        safetensors.numpy.save_file(llama_hf.to_hf(lm.family.init_params(cfg, jax.random.key(0)),
                                                   cfg), path)
        reader = SafetensorsReader([path])
        sizes = [reader.get(t).nbytes for t in reader.names()]
        mesh = Mesh(np.asarray(jax.devices()[2:4]), (sharding.TP_AXIS,))
        tracemalloc.start()
        jax.make_array_from_callback = measured
        try:
            host = lm.family.convert_hf(reader.get, cfg, np.float32, host=True)
            placed = sharding.stream_params(host, lm.family.param_axes(cfg), mesh, np.float32)
            jax.block_until_ready(placed)
        finally:
            jax.make_array_from_callback = make
            tracemalloc.stop()
        before = on_default()  # the old path, for contrast: convert onto the default device
        with jax.default_device(jax.devices()[0]):
            old = jax.block_until_ready(lm.family.convert_hf(reader.get, cfg, np.float32))
        old_default = new_bytes(before, on_default())
        del old
    out.update(staged=max(staged), largest=max(sizes), total=sum(sizes), gained=max(gained),
               old_default=old_default, tensors=len(sizes), calls=len(staged),
               placed_devices=sorted({d.id for x in jax.tree.leaves(placed)
                                      for d in x.sharding.device_set}))
    return out


def gdn_per_shard() -> dict:
    """The GDN layer's kernel per head shard (kernels_pallas/sharding.py) vs one call over all
    heads, random inputs (75 tokens, 2 key / 4 value heads): the largest difference per size."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from kernels_pallas import sharding as ks
    rng = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    args = [unit(rng.normal(size=(75, 2, 8))), unit(rng.normal(size=(75, 2, 8))),
            rng.normal(size=(75, 4, 8)), -0.3 * np.abs(rng.normal(size=(75, 4))),
            rng.uniform(size=(75, 4))]
    args = [jnp.asarray(a, jnp.float32) for a in args] + [
        jnp.asarray([0, 75], jnp.int32), jnp.asarray([0], jnp.int32),
        jnp.zeros((1, 4, 8, 8), jnp.float32)]
    base = jax.jit(lambda *a: ks.ragged_gated_delta(*a)[:2])(*args)
    out = {}
    for n in (2, 4):
        mesh = Mesh(np.asarray(jax.devices()[:n]), (ks.TP_AXIS,))

        def fn(*a):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return ks.ragged_gated_delta(*a)[:2]
        got = jax.jit(fn)(*[jax.device_put(a, NamedSharding(mesh, PartitionSpec()))
                            for a in args])
        out[n] = max(float(jnp.abs(x - y).max()) for x, y in zip(got, base))
    return out


def errors(name: str) -> list[str]:
    """The ValueError of each size the fixture cannot be split over (3 heads; 8 > 4 devices)."""
    out = []
    for tp in (3, 8):
        try:
            LLM(str(FIXTURES / name), warmup=False, num_kv_blocks=8, max_model_len=64, tensor_parallel_size=tp)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


if __name__ == "__main__":
    fixture, sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    result = {tp: run(fixture, tp) for tp in sizes}
    if "--hybrid" in sys.argv:  # a Qwen3.5 engine at TP=1 and 2 (any fixture's run)
        result["hybrid"] = {tp: hybrid(tp) for tp in (1, 2)}
        result["hybrid_in_place"] = hybrid_in_place(2)
    if "--errors" in sys.argv:
        result["errors"] = errors(fixture)
    if "--cached" in sys.argv:  # TP=1 and the sizes after it
        result["cached"] = {tp: cached(fixture, tp) for tp in sizes[:2]}
    if "--gdn" in sys.argv:
        result["gdn_per_shard"] = gdn_per_shard()
    if "--stream" in sys.argv:
        result["stream"] = stream(fixture)
    if "--checkpoints" in sys.argv:
        result["checkpoints"] = {tp: checkpoints(fixture, tp) for tp in sizes}
    print(json.dumps(result))
