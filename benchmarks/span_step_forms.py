"""span_step_work --time's forms of a step: module flags set while it is traced."""

from __future__ import annotations

import contextlib

# --time's forms of a step: module flags set while it is traced (FLAGS: program switches,
# serving/step/program_switches.py), each form naming what differs from today's defaults
# ("new"); "old" is session 20's step.
FLAGS = {"seq_parallel": ("kernels_pallas.gated_delta.ragged_triton", "SEQ_PARALLEL"),
         "joint": ("minipic_jax.models.qwen3_5_joint", "ENABLED"),
         "stream_bf16": ("kernels_pallas.gated_delta.ragged", "STREAM_QK_IN_V_DTYPE"),
         "store_stacked": ("serving.hybrid.span_maps", "STORE_STACKED"),
         "store_small": ("serving.hybrid.span_maps", "STORE_SMALL_STACKED"),
         "zero_flags": ("serving.hybrid.span_maps", "ZERO_FLAGS"),
         "states_in_place": ("kernels_pallas.gated_delta.state_rows", "STATES_IN_PLACE"),
         "stream_in_kernel": ("kernels_pallas.gated_delta.stream_rows", "STREAM_IN_KERNEL"),
         "conv_row_sum": ("minipic_jax.models.qwen3_5_gdn", "CONV_ROW_SUM"),
         "conv_shifted": ("minipic_jax.models.qwen3_5_gdn", "CONV_SHIFTED"),
         "conv_stacked": ("minipic_jax.models.qwen3_5_gdn", "CONV_STACKED_GATHER"),
         "pad_logits": ("minipic_jax.models.layers", "PAD_LOGITS_ROWS"),
         "finals": ("minipic_jax.models.qwen3_5", "GDN_FINALS_IN_PLACE"),
         "trans_in_stream": ("minipic_jax.models.qwen3_5_joint", "TRANSITIONS_IN_STREAM"),
         "span_finals": ("minipic_jax.models.qwen3_5_joint", "FINALS_IN_PLACE"),
         "pack_kernel": ("kernels_pallas.gated_delta.stream_pack", "PACK_KERNEL"),
         "scan_bv": ("kernels_pallas.gated_delta.ragged", "SCAN_BLOCK_V"),
         "flow_borrows": ("minipic_jax.models.qwen3_5_joint", "FLOW_BORROWS"),
         "one_rows": ("minipic_jax.models.qwen3_5", "ONE_ROWS_IN_PLACE"),
         "joint_one_rows": ("minipic_jax.models.qwen3_5_joint", "ONE_ROWS"),
         "rows_in_kernel": ("kernels_pallas.gated_delta.decode_rows", "ROWS_IN_KERNEL")}
FORMS = {"new": {}, "f32_qk": {"stream_bf16": False}, "serial_scan": {"seq_parallel": False},
         "apart": {"joint": False}, "stacked_store": {"store_stacked": True},
         "no_zero_flags": {"zero_flags": False}, "built_states": {"states_in_place": False},
         "stream_in_kernel": {"stream_in_kernel": True}, "conv_reduce": {"conv_row_sum": False},
         "conv_shifted": {"conv_shifted": True}, "conv_gathered": {"conv_shifted": False},
         "conv_stacked": {"conv_stacked": True}, "pad_logits": {"pad_logits": True},
         "finals_in_place": {"finals": True}, "finals_scattered": {"finals": False},
         "trans_scan": {"trans_in_stream": False}, "trans_in_stream": {"trans_in_stream": True},
         "span_both": {"span_finals": True, "trans_in_stream": False},
         "span_finals_off": {"span_finals": False}, "pack_off": {"pack_kernel": False},
         "borrow_off": {"flow_borrows": False}, "one_rows_off": {"one_rows": False},
         "span_one_rows": {"joint_one_rows": True}, "rows_in_kernel": {"rows_in_kernel": True},
         "span_one_rows_ik": {"joint_one_rows": True, "rows_in_kernel": True},
         "small_stacked": {"store_small": True},
         "old": {"seq_parallel": False, "joint": False, "stream_bf16": False,
                 "store_stacked": True, "zero_flags": False, "states_in_place": False,
                 "stream_in_kernel": False, "conv_row_sum": False, "conv_shifted": False,
                 "finals": False, "trans_in_stream": True, "span_finals": False,
                 "pack_kernel": False, "flow_borrows": False, "one_rows": False}}
FORMS.update({f"bv{n}": {"scan_bv": n} for n in (16, 32, 64, 128)})  # the scan's block_v


@contextlib.contextmanager
def as_form(form: str):
    """The step traced in `form` (FORMS): its flags set, all restored after."""
    import importlib
    mods = {name: importlib.import_module(m) for name, (m, _) in FLAGS.items()}
    saved = {name: getattr(mods[name], attr) for name, (_, attr) in FLAGS.items()}
    for name, value in FORMS[form].items():
        setattr(mods[name], FLAGS[name][1], value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(mods[name], FLAGS[name][1], value)
