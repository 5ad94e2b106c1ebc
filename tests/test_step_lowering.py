"""The engine step's kernels are traced and lowered once per step variant, not once per layer
(warm-up time on the GPU; benchmarks/lower_time.py measures it), and calling them through their
own jit leaves the program as it was: the steps of a 4-layer Llama and of tiny Qwen3.5 (3 GDN
layers), chosen as on a GPU and lowered for an abstract H100 on this CPU, run the same ops and
the same kernels (the inlined op counts of lower_time.program_ops, kernels keyed by a digest of
their IR) with each layer's K/V write and GDN kernels through one jitted function and with them
traced in every layer; the KV pool's reserve for the step is the same or within bytes."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import lower_time
from configs.presets import PRESETS
from kernels_pallas.gated_delta import ragged
from kernels_pallas.paged_attention import write
from serving.cache.step_temps import step_programs

TINY4 = dataclasses.replace(PRESETS["tiny_llama3"], num_layers=4)
TINY_QWEN = PRESETS["tiny_qwen3_5"]  # 3 GDN layers, 1 attention layer
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, max_model_len=256,
              block_size=16, num_kv_blocks=64)
# (kernel name in the lowered text, calls of it per general step) by model
KERNELS = {"llama": (TINY4, {"write_kv": 4}),
           "qwen": (TINY_QWEN, {"write_kv": 1, "_seq_scan_kernel": 3})}


def _lowered_steps(mcfg) -> tuple[list[str], list[int]]:
    """(the CUDA text of every warm-up variant of a fresh runner, the traced step's
    temporaries of its top-bucket variants: what the KV pool is sized by)."""
    with lower_time.as_on_gpu():
        runner = lower_time.build_runner(mcfg, "bfloat16", **ENGINE)
        texts = []
        for args, kw in lower_time.variant_args(runner, runner.warmup_steps()):
            with lower_time.on_h100():
                traced = runner._step.jitted.trace(*args, **kw)
                texts.append(traced.lower(lowering_platforms=("cuda",)).as_text())
        temps = [p.temp for p in step_programs(runner, runner._args, runner._step_impl,
                                               runner._step.donate_argnums)]
    return texts, temps


@functools.lru_cache(maxsize=None)
def _lowered_as_built(model: str) -> tuple[list[str], list[int]]:
    """_lowered_steps of KERNELS[model] with the kernels' jitted wrappers as shipped, lowered
    once per process for the two tests below (CI time: ~1-2.5 s a lowering)."""
    return _lowered_steps(KERNELS[model][0])


def _kernels_in(text: str, names) -> dict:
    return {n: text.count(f'name = "{n}"') for n in names}


def _inline_kernels(monkeypatch) -> None:
    """Every layer traces its kernels itself again (the jitted wrappers' bare functions)."""
    monkeypatch.setattr(write, "_write_once", write._write_once.__wrapped__)
    monkeypatch.setattr(ragged, "_packed_once", ragged._packed_once.__wrapped__)


@pytest.mark.parametrize("model", sorted(KERNELS))
def test_each_kernel_is_lowered_once_per_step(model):
    _, calls = KERNELS[model]
    texts, _ = _lowered_as_built(model)
    general = texts[0]  # warmup_steps: the general variants first
    assert _kernels_in(general, calls) == dict.fromkeys(calls, 1)
    ops = lower_time.program_ops(general)
    counts = sorted(c for n, c in ops.items() if n.startswith("stablehlo.custom_call"))
    for n in calls.values():  # each still run by every layer
        assert n in counts, ops


@pytest.mark.parametrize("model", sorted(KERNELS))
def test_jitted_kernels_keep_the_program(model, monkeypatch):
    mcfg, calls = KERNELS[model]
    once, temps = _lowered_as_built(model)
    _inline_kernels(monkeypatch)
    per_layer, temps_per_layer = _lowered_steps(mcfg)
    assert _kernels_in(per_layer[0], calls) == calls  # the lowering before the wrappers
    assert len(once) == len(per_layer) >= 2
    for a, b in zip(once, per_layer):
        ops_a, ops_b = lower_time.program_ops(a), lower_time.program_ops(b)
        assert ops_a == ops_b, (ops_a - ops_b, ops_b - ops_a)
        assert "sdy.sharding_constraint" not in a  # the Auto mesh: none, as on one GPU
    # the KV pool's reserve for the step (step_temps' liveness walk, which adds a nested
    # jit's own peak while it runs): the same for the Llama; for Qwen3.5 the GDN call's small
    # int buffers count a little differently (11,760 bytes here, of 374 kB since the packed
    # stream holds q / k in bf16, 448 kB before; 256 bytes of 1.17 GB at Qwen3.5-0.8B's
    # 2048-token step, where a KV block holds 196 kB)
    assert temps == temps_per_layer if model == "llama" else \
        abs(temps[0] - temps_per_layer[0]) <= 12 * 1024


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="counts XLA:CPU's instructions")
def test_xla_inlines_a_jitted_write_into_the_same_program():
    """On CPU (the XLA write): four layers' writes through the jitted function compile to the
    program of four inline writes, instruction for instruction."""
    sd = jax.ShapeDtypeStruct
    pages, rows = sd((8, 16, 2, 16), jnp.float32), sd((6, 2, 16), jnp.float32)
    options = write.WRITE["xla"].options()

    def step(run):
        def f(kp, vp, k, v, slots):
            for i in range(4):
                kp, vp = run(kp, vp, k * (i + 1), v - i, slots)
            return kp, vp
        return jax.jit(f, donate_argnums=(0, 1))

    def once(*a):
        return write._write_once(*a, name="xla", options=options)

    def inline(*a):
        return write.scatter_rows(*a)

    texts = [step(run).trace(pages, pages, rows, rows, sd((6,), jnp.int32)).lower().compile()
             .as_text() for run in (once, inline)]
    clean = [_canonical(t) for t in texts]
    assert clean[0] == clean[1]
    assert clean[0].count("scatter(") == 8


def _canonical(hlo: str) -> str:
    """Optimized HLO's computations without metadata and names (which say where an op came
    from; the source tables of the text's head go too)."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    hlo = re.sub(r"%[\w.\-]+", "%x", hlo)
    hlo = re.sub(r"[\w.\-]+(?=: \w+\[)", "p", hlo)  # parameter names in signatures
    return "\n".join(line for line in hlo.splitlines()
                     if line.startswith(("%", "ENTRY", "  ", "}")))


def test_program_ops_counts_calls_as_their_functions():
    @jax.jit
    def inner(a, b):
        return a * b + 1

    def nested(x, y):
        return inner(x, y) + inner(y, x)

    def flat(x, y):
        return (x * y + 1) + (y * x + 1)

    def other(x, y):
        return (x * y + 1) - (y * x + 1)

    x = np.ones(3, np.float32)
    counts = [lower_time.program_ops(jax.jit(f).trace(x, x).lower().as_text())
              for f in (nested, flat, other)]
    assert counts[0] == counts[1] != counts[2]
    assert counts[0]["stablehlo.multiply"] == 2


def test_the_bench_prints_each_variant(tmp_path, capsys):
    """`minipic-bench lower-time` end to end at a tiny shape: a row per warm-up variant with its
    ops digest, the totals, and the JSON."""
    import json

    from benchmarks.cli import main
    out = tmp_path / "lower.json"
    assert main(["lower-time", "--model", "tiny_llama3", "--max-num-batched-tokens", "64",
                 "--min-token-bucket", "64", "--max-model-len", "256", "--num-kv-blocks", "64",
                 "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["ops_digest"] in "\n".join(lines) for r in rows)
    assert lines[-1].startswith("tiny_llama3: 2 variants") and "process CPU" in lines[-1]
