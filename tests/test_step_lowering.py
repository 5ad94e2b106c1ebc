"""The engine step's kernels are traced and lowered once per step variant, not once per layer
(warm-up time on the GPU; benchmarks/lower_time.py measures it), and calling them through their
own jit leaves the program as it was: the step of a 4-layer Llama, chosen as on a GPU and
lowered for an abstract H100 on this CPU, runs the same ops and the same kernels (the inlined
op counts of lower_time.program_ops, kernels keyed by a digest of their IR) with each layer's
write through one jitted function and with the write traced in every layer."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import lower_time
from configs.presets import PRESETS
from kernels_pallas.paged_attention import write
from serving.cache import step_temps

TINY4 = dataclasses.replace(PRESETS["tiny_llama3"], num_layers=4)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, max_model_len=256,
              block_size=16, num_kv_blocks=64)


def _lowered_steps() -> tuple[list[str], list[int]]:
    """(the CUDA text of every warm-up variant of a fresh runner, the traced step's
    temporaries of its top-bucket variants: what the KV pool is sized by)."""
    with lower_time.as_on_gpu():
        runner = lower_time.build_runner(TINY4, "bfloat16", **ENGINE)
        texts = []
        for args, kw in lower_time.variant_args(runner, runner.warmup_steps()):
            with lower_time.on_h100():
                traced = runner._step.jitted.trace(*args, **kw)
                texts.append(traced.lower(lowering_platforms=("cuda",)).as_text())
        temps = [p.temp for p in step_temps.step_programs(runner, runner._args, runner._step_impl,
                                                          runner._step.donate_argnums)]
    return texts, temps


def test_the_write_kernel_is_lowered_once_per_step():
    texts, _ = _lowered_steps()
    assert len(texts) == 2  # the general and the decode-only variant
    for text in texts:
        assert text.count('name = "write_kv"') == 1, text.count('name = "write_kv"')
        ops = lower_time.program_ops(text)
        writes = [n for n, c in ops.items() if n.startswith("stablehlo.custom_call")
                  and c == TINY4.num_layers]
        assert writes, ops  # still run by every layer


def test_the_jitted_write_keeps_the_program(monkeypatch):
    once, temps = _lowered_steps()
    monkeypatch.setattr(write, "_write_once", write._write_once.__wrapped__)  # traced per call
    per_layer, temps_per_layer = _lowered_steps()
    assert [t.count('name = "write_kv"') for t in per_layer] == [TINY4.num_layers] * 2
    for a, b in zip(once, per_layer):
        ops_a, ops_b = lower_time.program_ops(a), lower_time.program_ops(b)
        assert ops_a == ops_b, (ops_a - ops_b, ops_b - ops_a)
        assert "sdy.sharding_constraint" not in a  # the Auto mesh: none, as on one GPU
    assert temps == temps_per_layer  # the KV pool's reserve for the step is the same


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
