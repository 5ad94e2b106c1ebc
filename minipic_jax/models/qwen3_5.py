"""Qwen3.5 text model (hybrid: Gated DeltaNet + gated full attention): the family contract.

Implements serving.model_contract.HybridModelFamily over the Flax NNX modules of
qwen3_5_modules.py, used pure-functionally: params are a plain nested dict (leaves are arrays;
per layer a dict, layers a tuple) that jitted steps take as an argument and
`qwen3_5_modules.bind` merges into the module graph inside the trace. Layers follow
`cfg.layer_types`: "full_attention" layers use paged KV (kernels_pallas.paged_attention) with the
sigmoid output gate, q/k RMSNorm (1 + w) and partial rotary; "linear_attention" layers are Gated
DeltaNet (qwen3_5_gdn.py) with a recurrent-state cache of `slots` entries, separate from the KV
pages, addressed by RecurrentMetadata.state_slots (qwen3_5_cache.py). HF transformers 5.24.0
`Qwen3_5ForCausalLM` is the oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from kernels_pallas.gated_delta.api import (GATED_DELTA, IMPLEMENTATIONS, as_rows, break_rows,
                                            choose, from_cache, ragged_packing)
from kernels_pallas.paged_attention.api import KV_MODES
from kernels_pallas.sharding import tp_mesh
from minipic_jax.models import qwen3_5_gdn, qwen3_5_joint, qwen3_5_spans
from minipic_jax.models import qwen3_5_modules as modules
from minipic_jax.models import layers, rope
from minipic_jax.models.paged_cache import paged_attend
from minipic_jax.models.param_fusion import fuse_layers
from minipic_jax.models.param_init import init_from_shapes
from minipic_jax.models.qwen3_5_cache import (Qwen35Cache, cache_axes, extract_state,
                                              init_cache, read_states, restore_state,
                                              state_layers, state_nbytes, with_state_layers,
                                              write_states)
from minipic_jax.models.qwen3_5_config import LAYER_TYPES, MODEL_TYPES, check, config_from_hf
from minipic_jax.models.qwen3_5_hf import convert_hf, hf_tensor_names
from serving.model_contract import CHECKPOINT_BREAKS, RecurrentMetadata

IS_HYBRID = True

__all__ = ["CHUNK", "GDN_IMPLS", "IS_HYBRID", "LAYER_TYPES", "MODEL_TYPES", "Qwen35Cache",
           "cache_axes", "config_from_hf", "convert_hf", "extract_state", "forward",
           "forward_with_checkpoints", "fuse_params", "hf_tensor_names", "init_cache",
           "init_params", "param_axes", "read_states", "restore_state", "state_layers",
           "state_nbytes", "unfuse_params", "with_state_layers", "write_states"]
CHUNK = 64  # recurrent checkpoint granularity (the chunked kernel's chunk size)
# A layer's checkpoint states are computed before its states are written back (an optimization
# barrier; forward_with_checkpoints' Returns says why). False: no barrier (A/B, benchmarks).
CHECKPOINTS_FIRST = True
# Decode steps step each GDN layer's states in place in the cache (`decode_in_place`; H100,
# 64 seats, 0.8B: decode step 2.28 -> 2.05 ms with the glue below, 507 -> 417 kernels;
# benchmarks/RESULTS.md, session 26).
GDN_DECODE_IN_PLACE = True
# ... with the layer's l2 norms, gates and gated norm in the same kernel (decode_layer_in_place).
GDN_DECODE_GLUE = True
# ... with the glue, also the causal conv, its conv state moved on in place too
# (decode_conv_layer_in_place; where each value head has its own key head, not under TP). Off:
# its kernel took 0.235 ms a step against the glue kernel's 0.127 (strided conv-state access)
# and the step 2.23 ms against 2.05 (H100, session 26).
GDN_DECODE_CONV = False
# A prefill step's flow (no span pieces, the host's static prefill kind) writes each sequence's
# final state into the layer's state cache from the scan kernel, in place (StateRows
# .write_final): no [S] finals and no scatter after it (on an H100 the scatter is 18 x 23 us,
# 0.41 ms of a 9.2 ms 1,024-token step of 16 sequences, s28-s30 profiles). On since session 31:
# rag's plain 1,024-token step 8.66 -> 7.96 ms on an H100 (benchmarks/RESULTS.md, "Position-
# independent spans on hybrid models"); its kernel's compiled tests pass there.
GDN_FINALS_IN_PLACE = True
# ... and its sequences of one row without a checkpoint (decodes riding with a prefill chunk)
# step their states with the decode kernel in place (gated_delta.api.one_rows_in_place): the
# chunked pass packs them as if they had no rows (ragged.packing's skip), where each took a
# whole 64-row chunk of its solve, output, pack and scan. Their rows' outputs are the decode
# kernel's, as in a decode-only step. Pallas GDN implementations only; a span step's joint
# stream too where qwen3_5_joint.ONE_ROWS. On since session 36 (H100: rag's 1,024-token plain
# step of a prefill and 15 decodes 8.60 -> 8.27 ms, busy 7.30 -> 6.81; compiled tests pass;
# benchmarks/RESULTS.md, "Position-independent spans on hybrid models").
ONE_ROWS_IN_PLACE = True
# the gated delta api's names (None: "auto"), and each Pallas one + "_interpret" (its kernels
# under the interpreter, for CPU tests): a new implementation needs no edit here
GDN_IMPLS = (None,) + IMPLEMENTATIONS + tuple(f"{name}_interpret" for name, impl
                                             in GATED_DELTA.items() if impl.backend != "xla")


# ----------------------------------------------------------------------------- params


def param_axes(cfg: ModelConfig) -> dict:
    """Logical axis names per param (same structure as the params; leaves are tuples of names),
    read from the Flax modules' annotations."""
    return modules.logical_axes(cfg)


def init_params(cfg: ModelConfig, key, dtype=jnp.float32) -> dict:
    """Deterministic random weights: normal(0, 0.02), 1-D leaves ones (A_log = 1, dt_bias = 1)."""
    return init_from_shapes(modules.shapes(cfg), key, dtype)


# the projections each fused layer concatenates (the arrays fuse_params consumes)
_MLP, _GDN, _ATTN = ("w_gate", "w_up"), ("w_qkv", "w_z", "w_b", "w_a"), ("wq", "wgate", "wk", "wv")


@jax.jit
def _fuse_layer(lp: dict) -> dict:
    """One layer's projections that read the same input, concatenated over their outputs."""
    mixer = dict(lp["mixer"])
    if "w_qkv" in mixer:  # GDN: [w_qkv | w_z | w_b | w_a]
        e = mixer["w_qkv"].shape[0]
        w_in = jnp.concatenate([mixer.pop(n).reshape(e, -1) for n in _GDN], axis=1)
        mixer["w_in"] = w_in
    else:  # gated attention: [wq | wgate | wk | wv] over heads
        mixer["wqgkv"] = jnp.concatenate([mixer.pop(n) for n in _ATTN], axis=1)
    out = {k: v for k, v in lp.items() if k not in _MLP}
    out["mixer"] = mixer
    out["w_gate_up"] = jnp.concatenate([lp["w_gate"], lp["w_up"]], axis=1)
    return out


def _consumed(lp: dict) -> list:
    return [lp[n] for n in _MLP] + [lp["mixer"][n] for n in _GDN + _ATTN if n in lp["mixer"]]


def fuse_params(params: dict, *, consume: bool = False) -> dict:
    """Params whose projections that read the same input are one matrix each (per layer: the
    GDN's qkv, z, b and a; the attention's q, gate, k and v; the MLP's gate and up), so a step
    runs 3 fewer GEMMs per GDN layer, 3 per attention layer and 1 per MLP (the same products:
    outputs agree up to each GEMM's accumulation order). One layer at a time; with consume=True
    each original array is deleted once fused (param_fusion.fuse_layers)."""
    return fuse_layers(params, _fuse_layer, _consumed, lambda lp: "w_gate_up" in lp,
                       consume=consume)


def unfuse_params(params: dict) -> dict:
    """fuse_params undone (slices of the fused arrays; unfused layers pass through)."""
    def one(lp):
        if "w_gate_up" not in lp:
            return lp
        f = lp["w_down"].shape[0]
        mixer = dict(lp["mixer"])
        if "w_in" in mixer:
            w_in, hv, dv = mixer.pop("w_in"), mixer["a_log"].shape[0], mixer["norm"].shape[0]
            e, c = w_in.shape[0], w_in.shape[1] - hv * dv - 2 * hv
            z_end = c + hv * dv
            mixer.update(w_qkv=w_in[:, :c], w_z=w_in[:, c:z_end].reshape(e, hv, dv),
                         w_b=w_in[:, z_end:z_end + hv], w_a=w_in[:, z_end + hv:])
        else:
            w, nh = mixer.pop("wqgkv"), mixer["wo"].shape[0]
            nk = (w.shape[1] - 2 * nh) // 2
            mixer.update(wq=w[:, :nh], wgate=w[:, nh:2 * nh], wk=w[:, 2 * nh:2 * nh + nk],
                         wv=w[:, 2 * nh + nk:])
        out = {k: v for k, v in lp.items() if k != "w_gate_up"}
        gu = lp["w_gate_up"]
        return {**out, "mixer": mixer, "w_gate": gu[:, :f], "w_up": gu[:, f:]}
    return {**params, "layers": tuple(one(lp) for lp in params["layers"])}


# ----------------------------------------------------------------------------- forward


def _recurrent_inputs(metadata, recurrent, n_seqs):
    cu = metadata.cu_q_lens
    lens = cu[1:] - cu[:-1]
    first = jnp.clip(cu[:-1], 0, metadata.num_tokens - 1)
    pos0 = jnp.where(lens > 0, metadata.q_positions[first], 0)  # [S]
    if recurrent is None:  # one slot per sequence, fresh when it starts at position 0
        recurrent = RecurrentMetadata(state_slots=jnp.arange(n_seqs, dtype=jnp.int32),
                                      reset=(lens > 0) & (pos0 == 0))
    return pos0, recurrent


def _gdn_step_inputs(metadata, pos0, decode, cfg, checkpoint_at, span_pieces,
                     gdn_impl=None) -> dict:
    """The GDN layers' keyword inputs: what they derive from the step's metadata alone is
    computed here, once per step, not in each layer (a GPU launches every small op of every
    layer): each row's sequence and conv window indices, the flow prefill's packing, and with
    span pieces their `qwen3_5_spans.prepare`. decode: the host's static step kind
    (RecurrentMetadata.decode): no conditional per GDN layer."""
    cu, n_rows = metadata.cu_q_lens, metadata.num_tokens
    seq_of_row = qwen3_5_gdn.rows_of_seqs(cu, n_rows)
    k1 = cfg.linear_conv_kernel_dim - 1
    conv_idx = qwen3_5_gdn.conv_index(cu, pos0, seq_of_row, k1, checkpoint_at)
    pieces, breaks = None, None
    if checkpoint_at is not None and decode is not True:  # one off-grid checkpoint a sequence
        breaks = break_rows(as_rows(checkpoint_at)[0], pos0, cu[1:] - cu[:-1], CHUNK,
                            CHECKPOINT_BREAKS)
    joint = span_pieces is not None and qwen3_5_joint.usable(cfg, decode)
    one_row = _one_rows(cu, checkpoint_at, span_pieces) if (
        ONE_ROWS_IN_PLACE and decode is False and tp_mesh() is None and _pallas_gdn(gdn_impl)
        and (span_pieces is None or joint and qwen3_5_joint.ONE_ROWS)) else None
    if span_pieces is not None:  # one conv window per row (the piece's or the flow's)
        pieces = qwen3_5_spans.with_windows(qwen3_5_spans.prepare(
            span_pieces, cu, n_rows, k1 + 1, CHUNK, pos0 if joint else None, breaks, one_row),
            conv_idx["rows"], cu.shape[0] - 1, k1)
    flow = not (decode or joint)  # the flow's own packing (a joint stream has its own)
    return dict(checkpoint_at=checkpoint_at, decode=decode, seq_of_row=seq_of_row,
                packing=ragged_packing(cu, pos0, n_rows, chunk=CHUNK, breaks=breaks,
                                       max_breaks=CHECKPOINT_BREAKS * (breaks is not None),
                                       skip=one_row)
                if flow else None, conv_idx=conv_idx, pieces=pieces, one_row=one_row)


def _pallas_gdn(gdn_impl) -> bool:
    """Whether the GDN layers run Pallas kernels (a compiled name, or one interpreted)."""
    name, interpret = qwen3_5_gdn.interpreted(gdn_impl)
    return choose(name, interpret=interpret) != "xla"


def _one_rows(cu_q_lens, checkpoint_at, span_pieces=None):
    """[S] bool the sequences a prefill step's GDN layers step with the decode kernel
    (ONE_ROWS_IN_PLACE): one row this step, no checkpoint, and in a span step a flow row (not
    a span row) of a sequence that carries no local state (SpanPieces.carry_local)."""
    one = cu_q_lens[1:] - cu_q_lens[:-1] == 1
    if span_pieces is not None:
        row = jnp.clip(cu_q_lens[:-1], 0, span_pieces.row_span.shape[0] - 1)
        one &= ~span_pieces.row_span[row] & ~span_pieces.carry_local
    if checkpoint_at is None:
        return one
    seq, at = as_rows(checkpoint_at)[0]
    has_ck = jnp.zeros(one.shape, bool).at[seq].max(at >= 0, mode="drop")
    return one & ~has_ck


def decode_in_place(decode, gdn_impl, checkpoint_at, span_pieces) -> bool:
    """Whether a step's GDN layers step their states in place in the cache
    (gated_delta.decode_triton): GDN_DECODE_IN_PLACE, a step the host knows is decode-only
    (no checkpoints, no span pieces) and a Pallas GDN implementation (compiled on a GPU, or
    "<name>_interpret" on the CPU); XLA ("xla", or None / "auto" as the api may pick it) keeps
    the gather / step / scatter."""
    return (GDN_DECODE_IN_PLACE and decode is True and checkpoint_at is None
            and span_pieces is None and gdn_impl not in (None, "auto", "xla"))


def _gdn_layer(block, x, cfg, conv_c, delta_c, recurrent, gdn_kw, layer, in_place, cu_q_lens,
               pos0):
    """One GDN block over the layer's state caches conv_c / delta_c: (x, the new caches,
    checkpoints or None, captured span maps or None). Its checkpoints are taken before its
    states are written back (CHECKPOINTS_FIRST); with `in_place` (decode_in_place) the kernel
    steps the states in delta_c itself; a plain prefill with GDN_FINALS_IN_PLACE (a span step's
    joint stream planned with qwen3_5_joint.FINALS_IN_PLACE) has the scan write its finals into
    delta_c."""
    slots, reset = recurrent.state_slots, recurrent.reset
    keep = ~reset[:, None, None]
    kw = dict(gdn_kw, pieces=qwen3_5_spans.for_layer(gdn_kw["pieces"], layer))
    conv_in = in_place and GDN_DECODE_GLUE and GDN_DECODE_CONV and tp_mesh() is None \
        and cfg.linear_num_key_heads == cfg.linear_num_value_heads
    conv0 = None if conv_in else jnp.where(keep, conv_c[slots], 0).astype(conv_c.dtype)
    finals_in_place = not in_place and tp_mesh() is None and (
        GDN_FINALS_IN_PLACE and recurrent.decode is False if kw["pieces"] is None
        else kw["pieces"].get("joint", {}).get("finals_in_place", False))  # joint: a prefill
    if in_place:  # the decode kernel reads and writes the layer's states in the cache
        delta0 = None
        kw["state_cache"] = qwen3_5_gdn.StateCache(delta_c, slots, ~reset, GDN_DECODE_GLUE,
                                                   conv_c if conv_in else None)
    else:  # the flow's states read in the cache by the kernels (no [S] copy); per head shard
        # under TP, an array; with finals_in_place the finals go back there (delta: the cache)
        delta0 = from_cache(delta_c, slots, ~reset, write_final=finals_in_place)
        delta0 = delta0 if tp_mesh() is None else delta0.materialize()
    x, (conv, delta, ck, maps) = block(x, cfg, _gdn_mix(conv0, delta0, cu_q_lens, pos0, cfg,
                                                        **kw))
    if ck is not None and CHECKPOINTS_FIRST:  # before the states are written back
        ck, conv, delta = jax.lax.optimization_barrier((ck, conv, delta))
    delta = delta if in_place or finals_in_place else delta_c.at[slots].set(delta)
    return x, conv if conv_in else conv_c.at[slots].set(conv), delta, ck, maps


def _attention_mix(attend, pages, cfg):
    """mix(mixer, h) for a full-attention block: (out, (k_pages, v_pages))."""
    return lambda mixer, h: mixer(h, cfg, attend, pages)


def _gdn_mix(conv0, delta0, cu_q_lens, pos0, cfg, **kw):
    """mix(mixer, h) for a GDN block: (out, (conv, delta, checkpoints or None, captured span
    maps or None))."""
    def mix(mixer, h):
        out, conv, delta, ck, maps = mixer(h, conv0, delta0, cu_q_lens, pos0, cfg, **kw)
        return out, (conv, delta, ck, maps)
    return mix


@layers.exact_float32
def forward_with_checkpoints(params: dict, tokens, metadata, cache: Qwen35Cache,
                             cfg: ModelConfig, *, recurrent=None, logits_indices=None,
                             kv_mode: str = "position_free", attn_impl: str | None = None,
                             checkpoint_at=None, gdn_impl: str | None = None,
                             write_impl: str | None = None, attn_options: dict | None = None,
                             span_pieces=None, stack_checkpoints: bool = True):
    """`forward`, plus the recurrent states at chunk-aligned positions of each sequence.

    checkpoint_at: None or [S, M] int32 absolute positions (multiples of CHUNK, or the end
      pos0 + new tokens, inside [pos0, pos0 + new tokens] of the sequence; -1 = none), or
      gated_delta.api.CheckpointRows (seq [K], pos [K]): the same as K flat rows (checkpoints
      then [Lg, K, ...]: the engine's step, which writes K states, not S M).
    gdn_impl: GDN prefill kernel, one of GDN_IMPLS: a name of kernels_pallas.gated_delta.api
      ("xla": lax.scan, "pallas_fused": Triton, "mosaic" / "mosaic_intra": Mosaic GPU; the
      engine passes Config.gdn.impl as resolved at start), None / "auto" (the api's choice), or
      a Pallas name + "_interpret" (those kernels interpreted, for CPU tests).
    span_pieces: None or qwen3_5_spans.SpanPieces when the step holds SSEP span rows (their
      attention window is metadata.q_window_start; see qwen3_5_spans.py for the GDN side; with
      .entry, pieces continuing a long span enter with its map so far).
    stack_checkpoints: False returns the checkpoints' conv and delta as tuples of Lg per-layer
      arrays (no stacked copy: a store can write each layer's rows straight into its pool
      layer, serving/hybrid/checkpoint_pool.py).
    Returns (logits [N, V] float32, cache, checkpoints) with checkpoints None or a dict
      conv [Lg, S, M, C, Kc-1], delta [Lg, S, M, Hv, Dk, Dv] float32 (Lg = GDN layers), each
      layer's computed before its states are written back (an optimization barrier: without
      it XLA fused every layer's selects of its starting states into one late fusion and copied
      seven layers' state caches twice to keep them, 14 x 68 MB a step at 64 seats; -4.0% /
      -1.8% a 128 / 1,024-token prefill step on the H100, benchmarks/RESULTS.md); with
      span_pieces.capture also span_maps: per GDN layer (tuples of Lg) a [Mc, Hv, Dk, Dk],
      b [Mc, Hv, Dk, Dv], tail [Mc, C, Kc-1], and count [Mc] (the captured pieces' maps,
      serving/hybrid/span_maps.py; not stacked: the store scatters each layer's).
    """
    if kv_mode not in KV_MODES:
        raise ValueError(f"forward: kv_mode must be one of {KV_MODES}, got {kv_mode!r}")
    if gdn_impl not in GDN_IMPLS:
        raise ValueError(f"forward: gdn_impl must be one of {GDN_IMPLS}, got {gdn_impl!r}")
    check(cfg)
    pos0, recurrent = _recurrent_inputs(metadata, recurrent, metadata.num_seqs)
    model = modules.bind(params, cfg)
    inv = rope.inv_freq(cfg)  # [R/2] numpy: a host constant (kernels build cos|sin tables once)
    attend = paged_attend(metadata, inv, attention_scaling=rope.attention_scaling(cfg),
                          kv_mode=kv_mode, attn_impl=attn_impl, write_impl=write_impl,
                          attn_options=attn_options)
    gdn_kw = _gdn_step_inputs(metadata, pos0, recurrent.decode, cfg, checkpoint_at, span_pieces,
                              gdn_impl)
    gdn_kw["impl"] = gdn_impl
    in_place = decode_in_place(recurrent.decode, gdn_impl, checkpoint_at, span_pieces)
    x = model.embed_tokens(tokens)  # [T, E]
    new = dict(k=[], v=[], conv=[], delta=[])
    ck_conv, ck_delta, span_maps = [], [], []
    for i, block in enumerate(model.layers):
        with jax.named_scope(f"layer_{i}"):
            if cfg.layer_types[i] == "full_attention":
                ia = len(new["k"])
                x, (kp, vp) = block(x, cfg, _attention_mix(attend, (cache.k[ia], cache.v[ia]),
                                                           cfg))
                new["k"].append(kp)
                new["v"].append(vp)
                continue
            g = len(new["conv"])
            x, conv, delta, ck, maps = _gdn_layer(block, x, cfg, cache.conv[g], cache.delta[g],
                                                  recurrent, gdn_kw, g, in_place,
                                                  metadata.cu_q_lens, pos0)
            new["conv"].append(conv)
            new["delta"].append(delta)
            if ck is not None:
                ck_conv.append(ck[0])
                ck_delta.append(ck[1])
            if maps is not None:
                span_maps.append(maps)
    with jax.named_scope("lm_head"):
        if logits_indices is not None:
            x = x[logits_indices]  # [N, E]
        logits = model.logits(x, cfg)  # [N, V] float32
    cache = Qwen35Cache(**{name: tuple(arrays) for name, arrays in new.items()})
    return logits, cache, _extras(ck_conv, ck_delta, span_maps, stack_checkpoints) or None


def _extras(ck_conv, ck_delta, span_maps, stack: bool) -> dict:
    """forward_with_checkpoints' third output: the layers' checkpoints (stacked, or tuples of
    per-layer arrays; none without checkpoint_at) and the captured span maps, layer-major."""
    out = {}
    if ck_conv:
        out = dict(conv=jnp.stack(ck_conv), delta=jnp.stack(ck_delta)) if stack \
            else dict(conv=tuple(ck_conv), delta=tuple(ck_delta))
    if span_maps:  # span_pieces.capture: per layer, span_maps.store scatters each
        out["span_maps"] = dict(
            a=tuple(m["a"] for m in span_maps), b=tuple(m["b"] for m in span_maps),
            tail=tuple(m["tail"] for m in span_maps), count=span_maps[0]["count"])
    return out


def forward(params: dict, tokens, metadata, cache: Qwen35Cache, cfg: ModelConfig, *,
            recurrent=None, logits_indices=None, kv_mode: str = "position_free",
            attn_impl: str | None = None, gdn_impl: str | None = None,
            write_impl: str | None = None, attn_options: dict | None = None, span_pieces=None):
    """One ragged step (serving.model_contract.ModelFamily.forward). `recurrent` gives each
    sequence's state slot and whether it starts fresh; None means slot s for sequence s, fresh
    when it starts at position 0. Sequences with no tokens this step keep their state.
    gdn_impl, span_pieces: see forward_with_checkpoints. Returns (logits, cache)."""
    logits, cache, _ = forward_with_checkpoints(
        params, tokens, metadata, cache, cfg, recurrent=recurrent, logits_indices=logits_indices,
        kv_mode=kv_mode, attn_impl=attn_impl, gdn_impl=gdn_impl, write_impl=write_impl,
        attn_options=attn_options, span_pieces=span_pieces)
    return logits, cache
