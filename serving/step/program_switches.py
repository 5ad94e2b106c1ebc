"""The module-level switches that change what a step compiles to.

Each keeps the other form of a measured change for A/B timing (benchmarks flip them in-process,
between engines). Two caches could serve a flipped switch the other form's program:
  * the stored step executables (executable_store.py): the runner's program context includes
    `values()`, so an executable is keyed by every switch's value;
  * JAX's in-process traces: a kernel under its own module-level jit (paged_attention's
    `_run_once`) keeps the form it was first traced with, so a bench flips switches through
    benchmarks/program_forms.py, which clears JAX's traces (session 25's first pre-rotation A/B
    timed one form twice without it).
A new switch of this kind goes in SWITCHES (tests/test_program_switches.py finds any module-level
boolean constant of the engine's packages that is in neither list).
"""

from __future__ import annotations

import sys

SWITCHES = (
    ("kernels_pallas.gated_delta.ragged", "STREAM_QK_IN_V_DTYPE"),
    ("kernels_pallas.gated_delta.ragged_triton", "SEQ_PARALLEL"),
    ("kernels_pallas.gated_delta.state_rows", "STATES_IN_PLACE"),
    ("kernels_pallas.gated_delta.decode_rows", "ROWS_IN_KERNEL"),
    ("kernels_pallas.gated_delta.stream_rows", "STREAM_IN_KERNEL"),
    ("kernels_pallas.gated_delta.stream_pack", "PACK_KERNEL"),
    ("kernels_pallas.paged_attention.mosaic_prefill_prep", "LIVE_GATHER"),
    ("kernels_pallas.paged_attention.triton_ragged", "LIVE_PREROTATE"),
    ("kernels_pallas.paged_attention.triton_decode", "WIDE_SPLITS"),
    ("kernels_pallas.paged_attention.triton_ragged", "RAGGED_SPLITS"),
    ("minipic_jax.models.layers", "PAD_LOGITS_ROWS"),
    ("minipic_jax.models.layers", "MLP_ROW_KERNEL"),
    ("minipic_jax.models.layers", "MIXER_ROW_KERNELS"),
    ("minipic_jax.models.qwen3_5", "CHECKPOINTS_FIRST"),
    ("minipic_jax.models.qwen3_5", "GDN_DECODE_IN_PLACE"),
    ("minipic_jax.models.qwen3_5", "GDN_DECODE_GLUE"),
    ("minipic_jax.models.qwen3_5", "GDN_DECODE_CONV"),
    ("minipic_jax.models.qwen3_5", "GDN_FINALS_IN_PLACE"),
    ("minipic_jax.models.qwen3_5", "ONE_ROWS_IN_PLACE"),
    ("minipic_jax.models.qwen3_5_gdn", "CONV_ROW_SUM"),
    ("minipic_jax.models.qwen3_5_gdn", "CONV_SHIFTED"),
    ("minipic_jax.models.qwen3_5_gdn", "CONV_STACKED_GATHER"),
    ("minipic_jax.models.qwen3_5_gdn", "DECODE_CONV_DIRECT"),
    ("minipic_jax.models.qwen3_5_gdn", "DECODE_SEQ_ROWS"),
    ("minipic_jax.models.qwen3_5_gdn", "DECODE_GATES_IN_PROJ"),
    ("minipic_jax.models.qwen3_5_joint", "ENABLED"),
    ("minipic_jax.models.qwen3_5_joint", "TRANSITIONS_IN_STREAM"),
    ("minipic_jax.models.qwen3_5_joint", "FINALS_IN_PLACE"),
    ("minipic_jax.models.qwen3_5_joint", "FLOW_BORROWS"),
    ("minipic_jax.models.qwen3_5_joint", "ONE_ROWS"),
    ("serving.hybrid.chain_compose", "AUTO_KERNEL"),
    ("serving.hybrid.checkpoint_pool", "CHECKPOINTS_STACKED"),
    ("serving.hybrid.span_maps", "COMPOSE_IN_PLACE"),
    ("serving.cache.page_zeroing", "ZERO_KERNEL"),
    ("serving.hybrid.span_maps", "STORE_STACKED"),
    ("serving.hybrid.span_maps", "STORE_SMALL_STACKED"),
    ("serving.hybrid.span_maps", "ZERO_FLAGS"),
)
# module-level booleans that do not change a step's program (what a model family is; the pool's
# size, which reaches the step through its arguments' shapes)
NOT_SWITCHES = (
    ("minipic_jax.models.llama", "IS_HYBRID"),
    ("minipic_jax.models.qwen3_5", "IS_HYBRID"),
    ("serving.cache.kv_pool", "CAP_BY_XLA_LIMIT"),
)


def values() -> tuple:
    """(module, name, value) of every switch of a module already imported (one not imported
    cannot have shaped a trace of this process: None)."""
    out = []
    for module, name in SWITCHES:
        mod = sys.modules.get(module)
        out.append((module, name, None if mod is None else getattr(mod, name)))
    return tuple(out)
