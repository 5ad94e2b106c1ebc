"""Subprocess half of tests/test_weights_update_tp.py (needs
XLA_FLAGS=--xla_force_host_platform_device_count=2 before JAX starts): `LLM.update_weights` at
tensor_parallel_size=2 on the llama_gqa2_llama3rope fixture (the engine shape
tests/tp_runs.py compiles), the write programs' memory at the llama3_8b shape over TP 2, and a
one-KV-head model's write (KV heads repeated in the program). Prints one JSON line.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks.compile_counter import CompileCounter
from minipic_jax import LLM, SamplingParams, weights_update
from minipic_jax.loading import load_model
from tests.conftest import FIXTURES
from tests.tp_runs import MAX_TOKENS, _prompts

NAME = "llama_gqa2_llama3rope"
ARGS = dict(warmup=False, dtype="float32", seed=0, max_num_seqs=4, max_num_batched_tokens=32,
            min_token_bucket=32, max_model_len=192, block_size=16, num_kv_blocks=64,
            tensor_parallel_size=2)  # tests/tp_runs.py's engine
SP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)


def compiles_during(fn, *args) -> int:
    """How many XLA programs `fn(*args)` compiled (benchmarks/compile_counter.py)."""
    counter = CompileCounter()
    fn(*args)
    return counter.read()["xla_compiles"]


def outputs(llm, prompts) -> dict:
    outs = llm.generate(prompts, SP, use_tqdm=False)
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                        o.outputs[0].token_ids)] for o in outs]}


def pointers(params) -> list:
    return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(params)
            for s in x.addressable_shards]


def rolled_checkpoint(tmp: pathlib.Path) -> tuple:
    """The fixture's weights, each rolled by one along its last axis (other weights of the same
    shapes and scale), as params and as a checkpoint folder a fresh engine loads."""
    lm = load_model(str(FIXTURES / NAME))
    old = jax.tree.map(np.asarray, lm.params)
    new = jax.tree.map(lambda x: np.roll(x, 1, axis=-1), old)
    import safetensors.numpy
    shutil.copy(FIXTURES / NAME / "config.json", tmp / "config.json")
    safetensors.numpy.save_file(lm.family.to_hf(new, lm.cfg), tmp / "model.safetensors")
    return new, old


def bad_inputs(llm, new) -> list:
    """The error each bad params tree raised ("ValueError: ..."; None where none was)."""
    dead = jax.device_put(new["layers"][1]["wk"])
    dead.delete()
    cases = [
        {**new, "layers": (new["layers"][0], {**new["layers"][1], "wq": np.zeros((32, 4))})},
        {**new, "final_norm": new["final_norm"].astype(np.float16)},
        {k: v for k, v in new.items() if k != "lm_head"},
        {**new, "layers": (new["layers"][0], {**new["layers"][1], "wk": dead})},
    ]
    errs = []
    for params in cases:
        try:
            llm.update_weights(params)
            errs.append(None)
        except Exception as e:  # noqa: BLE001 (the test checks which)
            errs.append(f"{type(e).__name__}: {e}")
    return errs


def by_rules_table(llm, params):
    """`params` placed by the rules table (as served: this fixture's 2 KV heads split over 2
    devices, none repeated), which the engine takes without a copy."""
    from serving.step import sharding
    loaded, runner = llm.llm_engine.loaded, llm.llm_engine.runner
    assert sharding.kv_replication(loaded.cfg, 2) == 1
    targets = sharding.shardings(params, loaded.family.param_axes(loaded.cfg), runner.mesh)
    return jax.tree.map(jax.device_put, params, targets)


def engine_case() -> dict:
    """Updates from host arrays, from arrays placed by the rules table, from donated arrays on
    one device and from arrays replicated over the mesh: outputs, served buffers, compiles; then
    bad params."""
    ref = np.load(FIXTURES / NAME / "reference.npz")
    llm = LLM(str(FIXTURES / NAME), **ARGS)
    prompts = sum(_prompts(llm, ref), [])
    runner, out = llm.llm_engine.runner, {}
    out["before"] = outputs(llm, prompts)
    with tempfile.TemporaryDirectory() as tmp:
        new, old = rolled_checkpoint(pathlib.Path(tmp))
        out["fresh"] = outputs(LLM(tmp, **ARGS), prompts)
    out["prepared"] = [weights_update.prepare(llm), weights_update.prepare(llm)]
    steps, placement = runner.num_compiles, [x.sharding for x in jax.tree.leaves(runner.params)]
    counts = [compiles_during(llm.update_weights, new)]  # host (numpy) arrays: sliced per device
    out["after"] = outputs(llm, prompts)
    kept = pointers(runner.params)  # (the loaded leaves may wrap host memory: compared from here)
    theirs = by_rules_table(llm, old)
    counts.append(compiles_during(llm.update_weights, theirs))  # taken as they are: no copy
    out["theirs_kept"] = not any(x.is_deleted() for x in jax.tree.leaves(theirs))
    out["kept"] = [pointers(runner.params) == kept]
    out["back"] = outputs(llm, prompts)
    theirs = jax.device_put(new, jax.devices()[0])  # one device: JAX slices it per device
    llm.update_weights(theirs, donate=True)
    out["kept"].append(pointers(runner.params) == kept)
    out.update(update_compiles=counts, step_retraces=runner.num_compiles - steps,
               write_programs=getattr(llm.weights_version.writer, "compiles", 0),
               donated_deleted=all(x.is_deleted() for x in jax.tree.leaves(theirs)),
               placement_kept=placement == [x.sharding for x in jax.tree.leaves(runner.params)],
               final=outputs(llm, prompts))
    # another layout on the mesh (replicated): resharded inside new write programs
    llm.update_weights(jax.device_put(old, NamedSharding(runner.mesh, PartitionSpec())))
    out["kept"].append(pointers(runner.params) == kept)
    out["other_layout"] = outputs(llm, prompts)
    out["other_layout_programs"] = getattr(llm.weights_version.writer, "compiles", 0)
    out["bad"] = guarded(bad_case, llm, new, kept, prompts)  # last: the old code broke there
    return out


def bad_case(llm, new, kept, prompts) -> dict:
    """Bad params refused: their errors, then whether the served buffers and generation stayed,
    and the outputs."""
    errors = bad_inputs(llm, new)
    return {"errors": errors, "outputs": outputs(llm, prompts),
            "kept": pointers(llm.llm_engine.runner.params) == kept
            and llm.weights_version.generation == 4}


def memory_case(num_kv_heads: int) -> dict:
    """The write programs at the llama3_8b bf16 shape (with `num_kv_heads`) over TP 2, compiled
    from shapes alone: per device, bytes not written in place, temporaries, one layer."""
    import dataclasses

    import jax.numpy as jnp

    from configs.presets import get_preset
    from minipic_jax.models import llama_modules
    from minipic_jax.weights_write import ShardedWeightsWriter
    from serving.step import sharding
    cfg = dataclasses.replace(get_preset("llama3_8b"), num_kv_heads=num_kv_heads)
    mesh, copies = sharding.make_mesh(2), sharding.kv_replication(cfg, 2)
    axes = llama_modules.logical_axes(cfg)
    new = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16), llama_modules.shapes(cfg),
                       is_leaf=lambda s: isinstance(s, tuple) and not isinstance(s[0], dict))
    served = jax.eval_shape(lambda p: sharding.replicate_kv_heads(p, axes, copies), new)

    def placed(tree, targets):
        return jax.tree.map(lambda s, t: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=t),
                            tree, targets)
    served = placed(served, sharding.shardings(served, axes, mesh))
    new = placed(new, sharding.source_shardings(new, axes, mesh, copies))
    writer, top = ShardedWeightsWriter(copies), ["embed", "final_norm", "lm_head"]
    rows = []
    for s, n, a in (({k: served[k] for k in top}, {k: new[k] for k in top}, {k: axes[k] for k in top}),
                    (served["layers"][0], new["layers"][0], axes["layers"][0])):
        mem = writer.compile(s, n, a).memory_analysis()
        rows.append({"not_aliased": mem.output_size_in_bytes - mem.alias_size_in_bytes,
                     "temp": mem.temp_size_in_bytes, "outputs": mem.output_size_in_bytes})
    layer = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * 2
                for x in jax.tree.leaves(served["layers"][0]))
    return {"copies": copies, "layer_bytes_per_device": layer, "programs": rows}


def replicated_case() -> dict:
    """mistral_gqa4 (one KV head) over 2 devices: each device keeps a copy of the head. The
    write program's result equals the load's placement of the new weights, in the same
    buffers."""
    from serving.step import sharding
    from minipic_jax.weights_write import ShardedWeightsWriter
    lm = load_model(str(FIXTURES / "mistral_gqa4"))
    new = jax.tree.map(lambda x: np.roll(np.asarray(x), 1, axis=-1), lm.params)
    axes, copies = lm.family.param_axes(lm.cfg), sharding.kv_replication(lm.cfg, 2)
    mesh, _ = sharding.place_model(lm, 2)
    served, writer = lm.params, ShardedWeightsWriter(copies)
    layer, a = served["layers"][0], axes["layers"][0]
    before = pointers(layer)
    given = jax.tree.map(jax.device_put, new["layers"][0],
                         sharding.source_shardings(new["layers"][0], a, mesh, copies))
    got = writer(layer, given, a)
    want = sharding.shard_params(sharding.replicate_kv_heads(
        jax.tree.map(np.asarray, new["layers"][0]), a, copies), a, mesh)
    return {"copies": copies, "same_buffers": pointers(got) == before,
            "equal": all(x.sharding == y.sharding and np.array_equal(x, y) for x, y in
                         zip(jax.tree.leaves(got), jax.tree.leaves(want)))}


def bench_case() -> dict:
    """benchmarks/rl_measure.update_timing on this engine at TP=2 (what `minipic-bench rl
    --update-timing --tensor-parallel 2` runs on GPUs; CPU devices keep no allocator stats)."""
    from benchmarks import rl_measure
    args = {k: v for k, v in ARGS.items() if k not in ("dtype", "seed")}
    got = rl_measure.update_timing(str(FIXTURES / NAME), "float32", repeats=2, **args)
    return {k: got[k] for k in ("tensor_parallel_size", "layer_bytes", "write_programs_prepared",
                                "generate_compiles_after")} | {
        "compiles": [r["compiles"] for r in got["updates"]],
        "step_retraces": [r["step_retraces"] for r in got["updates"]]}


def guarded(fn, *args):
    """fn's result, or its error (each part of the run is checked by a test of its own)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:3000]}


if __name__ == "__main__":
    print(json.dumps({"engine": guarded(engine_case),
                      "memory": [guarded(memory_case, 8), guarded(memory_case, 1)],
                      "replicated": guarded(replicated_case), "bench": guarded(bench_case)}))
