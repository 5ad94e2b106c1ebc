"""Qwen3.5 Gated DeltaNet token mixer over a ragged batch, with its per-slot state.

Shape letters beyond configs/model_config.py: C conv channels (2 Hk Dk + Hv Dv), Kc conv kernel,
Hk/Hv linear-attention key/value heads, Dk/Dv their head dims, M checkpoints per sequence.

HF transformers 5.24.0 `Qwen3_5GatedDeltaNet` is the oracle: in_proj_qkv -> causal depthwise conv
(state = the last Kc - 1 inputs) -> silu -> split q/k/v; beta = sigmoid(b); g = -exp(A_log) *
softplus(a + dt_bias); q, k L2-normalised in float32; gated delta rule; RMSNormGated (weight * x,
no unit offset) times silu(z); out_proj.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas.gated_delta.api import (StateRows, choose, on_rows, on_seq_rows,
                                            seq_rows)
from kernels_pallas.gated_delta.api import ragged_decode_conv_layer_in_place  # no TP form
from kernels_pallas.sharding import (ragged_decode_in_place,  # per head shard under TP
                                     ragged_decode_layer_in_place, tp_mesh, whole)
from minipic_jax.models import layers, qwen3_5_spans
# the recurrence over a step's rows and a decode step's state cache (qwen3_5_gdn_core.py)
from minipic_jax.models.qwen3_5_gdn_core import StateCache, recurrent_core  # noqa: F401
from minipic_jax.models.qwen3_5_conv_index import (conv_index, history_index,  # noqa: F401
                                                   history_rows, read_history, rows_of_seqs)
from minipic_jax.models.qwen3_5_decode_conv import decode_history, decode_taps
from minipic_jax.models.nnx_pure import param
from serving.model_contract import SpanPieces


# The causal conv as its Kc tap products summed in order over [T, C] rows (conv_rows_silu); False:
# an einsum over the window's minor Kc axis, a reduce fusion that reads across C (A/B timing)
CONV_ROW_SUM = True
# ... and its taps read as static shifts of the step's inputs (rows of the same sequence) or rows
# of the conv state laid [S * (Kc-1), C] (before): no per-element row index, both reads along C.
# The same values and sums as the gathers (False: `history_rows`). H100, 1,024 tokens x 16 seats:
# the conv's fusion 0.90 -> 0.68 ms a step, the plain step 9.20 -> 8.83 ms (benchmarks/RESULTS.md,
# "Position-independent spans on hybrid models"; span steps read their windows another way).
CONV_SHIFTED = True
# ... or one row gather each from the step's inputs over the conv state's rows stacked (the span
# steps' `qwen3_5_spans.window_rows`: < 0.29 ms a step vs 0.68 shifted, H100 s28). Off: untimed.
CONV_STACKED_GATHER = False
# A decode step's conv (in-place decode with glue, <= 1 new token a sequence) read straight from
# the conv state, which moves on by the sequence's row (`decode_taps`, `decode_history`): no
# history index, bit for bit the general form's values. False: the general form.
DECODE_CONV_DIRECT = True
# ... and the whole decode layer run per sequence: a decode-only step lays sequence i's token on
# row i (RecurrentMetadata.decode), so rows are sequences by a static slice (decode_rows.seq_rows)
# where the general form gathered the kernel's inputs and its output. Bit for bit the same
# (H100, 64 seats: decode step 2.31 ms vs 2.33 general, 381 kernels vs 365: s30).
DECODE_SEQ_ROWS = True
# ... with a, b and z read by the decode kernel in the fused projection itself: each sliced
# operand was a copy kernel (`wrapped_slice`), 54 of the 64-seat decode step's 380 on an H100
# (s30b). The same bits. Off: undecided (s36c: busy -0.05 ms, wall within noise).
DECODE_GATES_IN_PROJ = False


def interpreted(impl):
    """(the kernel name, whether interpreted) of a GDN `impl` name: a Pallas name + "_interpret"
    runs that kernel under the interpreter."""
    interpret = bool(impl) and impl.endswith("_interpret")
    return (impl.removesuffix("_interpret") if interpret else impl), interpret


def gdn_dims(cfg):
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return hk, hv, dk, dv, 2 * hk * dk + hv * dv, cfg.linear_conv_kernel_dim


def state_shapes(cfg, slots: int):
    """(conv [slots, C, Kc - 1], delta [slots, Hv, Dk, Dv]) of one GDN layer."""
    hk, hv, dk, dv, c, kc = gdn_dims(cfg)
    return (slots, c, kc - 1), (slots, hv, dk, dv)


def l2norm(x, eps=1e-6):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x, conv_w, conv0, cu_q_lens, pos0, seq_of_row, index=None):
    """Depthwise causal conv of each sequence's new inputs, left context from its conv state.

    x [T, C]; conv_w [C, Kc]; conv0 [S, C, Kc-1]; index: None or conv_index(...)["rows"].
    Returns silu(conv) [T, C] (float32 math).
    """
    if index is None:
        index = conv_index(cu_q_lens, pos0, seq_of_row, conv0.shape[-1])["rows"]
    if CONV_STACKED_GATHER:
        return conv_rows_silu(stacked_taps(x, conv0, index) + [x], conv_w)
    if CONV_SHIFTED:
        return conv_rows_silu(shifted_taps(x, conv0, index) + [x], conv_w)
    past = history_rows(x, conv0, index)  # [T, Kc-1, C]
    return conv_rows_silu([past[:, i] for i in range(past.shape[1])] + [x], conv_w)


def stacked_taps(x, conv0, index):
    """history_rows as Kc-1 arrays [T, C] (oldest first), each one gather from the step's inputs
    stacked over the conv state's rows [S * (Kc-1), C] (no select)."""
    rows, seq, col, from_x = index
    n, k1 = x.shape[0], conv0.shape[-1]
    src = jnp.concatenate([x, qwen3_5_spans.state_rows(conv0, x.dtype)], axis=0)
    at = jnp.where(from_x, rows, n + seq * k1 + col)
    return [src.at[at[:, j]].get(wrap_negative_indices=False) for j in range(k1)]


def shifted_taps(x, conv0, index):
    """history_rows of the rows' own windows as Kc-1 arrays [T, C] (oldest first): tap j of row
    t is row t - (Kc-1) + j of the step's inputs where that row is the sequence's (`from_x`:
    history_index puts it there), else the conv state's column."""
    _, seq, col, from_x = index
    n, k1 = x.shape[0], conv0.shape[-1]
    old = qwen3_5_spans.state_rows(conv0, x.dtype)  # [S * K1, C]
    taps = []
    for j in range(k1):
        shift = jnp.pad(x, ((k1 - j, 0), (0, 0)))[:n]
        state = old.at[seq[:, j] * k1 + col[:, j]].get(wrap_negative_indices=False)
        taps.append(jnp.where(from_x[:, j, None], shift, state))
    return taps


def conv_silu(window, conv_w):
    """silu of the depthwise conv of windows [T, C, Kc] (oldest first) with conv_w [C, Kc]:
    [T, C], float32 math."""
    return conv_rows_silu([window[..., i] for i in range(window.shape[-1])], conv_w)


def conv_rows_silu(rows, conv_w):
    """silu of the depthwise conv of the Kc inputs `rows` (a list of [T, C], oldest first) with
    conv_w [C, Kc]: [T, C], float32 math. CONV_ROW_SUM: the products summed in tap order, an
    elementwise fusion that reads each input along C; else the einsum over a [T, C, Kc] window."""
    w = conv_w.astype(jnp.float32)
    if not CONV_ROW_SUM:
        window = jnp.stack(rows, axis=-1).astype(jnp.float32)
        return jax.nn.silu(jnp.einsum("tck,ck->tc", window, w))
    out = rows[0].astype(jnp.float32) * w[:, 0]
    for i in range(1, len(rows)):
        out = out + rows[i].astype(jnp.float32) * w[:, i]
    return jax.nn.silu(out)


def gated_rms_norm(x, gate, weight, eps):
    """HF Qwen3_5RMSNormGated: weight * normalise(x) (cast back), times silu(gate) in float32."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    out = weight * normed.astype(dtype)
    return (out.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)


class GatedDeltaNet(nnx.Module):
    """The GDN token mixer of one linear-attention layer (HF Qwen3_5GatedDeltaNet's weights)."""

    def __init__(self, cfg, dtype=jnp.float32, *, fused: bool = False):
        e = cfg.hidden_size
        hk, hv, dk, dv, c, kc = gdn_dims(cfg)
        if fused:  # [w_qkv | w_z | w_b | w_a] over their outputs: one GEMM (qwen3_5.fuse_params)
            self.w_in = param((e, c + hv * dv + 2 * hv), ("embed", "gdn_in"), dtype)
        else:
            self.w_qkv = param((e, c), ("embed", "gdn_conv"), dtype)
            self.w_z = param((e, hv, dv), ("embed", "gdn_heads", "gdn_v"), dtype)
            self.w_b = param((e, hv), ("embed", "gdn_heads"), dtype)
            self.w_a = param((e, hv), ("embed", "gdn_heads"), dtype)
        self.conv_w = param((c, kc), ("gdn_conv", None), dtype)
        self.dt_bias = param((hv,), ("gdn_heads",), dtype)
        self.a_log = param((hv,), ("gdn_heads",), dtype)
        self.norm = param((dv,), ("gdn_v",), dtype)
        self.w_out = param((hv, dv, e), ("gdn_heads", "gdn_v", "embed"), dtype)

    def projections(self, h, cfg):
        """(mixed [T, C], z [T, Hv, Dv], b, a [T, Hv]) of normed h [T, E], and with fused
        weights the fused projection x [T, C + Hv Dv + 2 Hv] they are columns of (z from
        column C, then b, then a), else None."""
        if not hasattr(self, "w_in"):
            h = layers.normed(h)
            return (jnp.einsum("te,ec->tc", h, self.w_qkv[...]),
                    jnp.einsum("te,ehv->thv", h, self.w_z[...]),
                    jnp.einsum("te,eh->th", h, self.w_b[...]),
                    jnp.einsum("te,eh->th", h, self.w_a[...])), None
        _, hv, _, dv, c, _ = gdn_dims(cfg)
        x = layers.project(h, self.w_in[...])  # [T, C + Hv Dv + 2 Hv] (a Normed's norm in it)
        z_end = c + hv * dv
        return (x[:, :c], x[:, c:z_end].reshape(-1, hv, dv), x[:, z_end:z_end + hv],
                x[:, z_end + hv:]), x

    def conv_qkv(self, mixed, dtype, conv0, cu_q_lens, pos0, seq_of_row, rows, pieces, cfg):
        """q, k [T, Hk, Dk] and v [T, Hv, Dv] (in `dtype`, before the l2 norms) of the mixed
        projection [T, C]: its causal conv from each sequence's conv state (span rows: their
        piece's window, zeros before the span start)."""
        conv_w = self.conv_w[...]  # [C, Kc]
        if pieces is None:
            conv_out = causal_conv(mixed, conv_w, conv0, cu_q_lens, pos0, seq_of_row, rows)
        else:
            conv_out = conv_rows_silu(qwen3_5_spans.window_rows(mixed, conv0, pieces), conv_w)
        return self.split_qkv(conv_out, dtype, cfg)

    @staticmethod
    def split_qkv(conv_out, dtype, cfg):
        """q, k [T, Hk, Dk] and v [T, Hv, Dv] in `dtype` of the conv's output [T, C]."""
        hk, hv, dk, dv, _, _ = gdn_dims(cfg)
        n_tokens = conv_out.shape[0]
        # whole on every device under TP (the rules keep [q | k | v] whole): a split over the
        # channels made the q / k L2 norms cross devices (kernels_pallas/sharding.whole)
        conv_out = whole(conv_out.astype(dtype))
        return (conv_out[:, :hk * dk].reshape(n_tokens, hk, dk),
                conv_out[:, hk * dk:2 * hk * dk].reshape(n_tokens, hk, dk),
                conv_out[:, 2 * hk * dk:].reshape(n_tokens, hv, dv))

    def decode_in_place(self, mixed, z, b, a, dtype, conv0, cu_q_lens, pos0, seq_of_row,
                        conv_idx, cfg, state_cache, interpret, proj=None, h=None):
        """A decode step's layer core in one kernel over the state cache (StateCache with glue;
        with its conv cache, the causal conv too): (the mixer's output [T, E], the conv state:
        per sequence [S, C, Kc-1], or the whole conv cache moved on in place, the state cache).
        Without the conv the projection runs on the sequences' rows and a gather the residual
        add takes in maps them to the step's rows (a scatter was a kernel a layer)."""
        sc, norm = state_cache, (self.a_log[...], self.dt_bias[...], z, self.norm[...])
        w_out = self.w_out[...]
        if sc.conv is not None:
            normed, conv, delta = ragged_decode_conv_layer_in_place(
                mixed, self.conv_w[...], sc.conv, a, b, *norm, cu_q_lens, sc.cache, sc.slots,
                sc.keep, eps=cfg.rms_norm_eps, interpret=interpret)
            return jnp.einsum("thv,hve->te", normed, w_out), conv, delta
        n_seqs = conv0.shape[0]
        # sequence i's token is row i (fewer rows than sequences: the rows form, s29d's H100)
        if DECODE_SEQ_ROWS and mixed.shape[0] >= n_seqs:
            xs = seq_rows(mixed, n_seqs)
            q, k, v = self.split_qkv(conv_rows_silu(decode_taps(xs, conv0), self.conv_w[...]),
                                     dtype, cfg)
            conv = decode_history(xs, conv0, cu_q_lens, per_seq=True)
            # a, b, z read in the projection (one device: its columns' heads are global)
            if DECODE_GATES_IN_PROJ and proj is not None and tp_mesh() is None:
                gates, in_proj = (None, None), (proj, gdn_dims(cfg)[4])
                norm = (*norm[:2], None, norm[3])
            else:
                gates, in_proj = (seq_rows(a, n_seqs), seq_rows(b, n_seqs)), None
                norm = (*norm[:2], seq_rows(z, n_seqs), norm[3])
            normed, delta = ragged_decode_layer_in_place(
                q, k, v, *gates, *norm, cu_q_lens, sc.cache, sc.slots, sc.keep,
                eps=cfg.rms_norm_eps, interpret=interpret, to_rows=False, per_seq=True,
                proj=in_proj)
            if isinstance(h, layers.Normed):  # rows first (the kernel's are 0 where no token:
                rows = normed if n_seqs == mixed.shape[0] else on_seq_rows(  # no select then)
                    normed, cu_q_lens, mixed.shape[0], normed.dtype)
                return self.output(rows, h), conv, delta
            out = jnp.einsum("thv,hve->te", normed, w_out)
            return on_seq_rows(out, cu_q_lens, mixed.shape[0], out.dtype), conv, delta
        if DECODE_CONV_DIRECT:
            q, k, v = self.split_qkv(conv_rows_silu(decode_taps(mixed, conv0, seq_of_row),
                                                    self.conv_w[...]), dtype, cfg)
            conv = decode_history(mixed, conv0, cu_q_lens)
        else:
            q, k, v = self.conv_qkv(mixed, dtype, conv0, cu_q_lens, pos0, seq_of_row,
                                    conv_idx["rows"], None, cfg)
            conv = read_history(mixed, conv0, conv_idx["end"]).astype(conv0.dtype)
        normed, delta = ragged_decode_layer_in_place(q, k, v, a, b, *norm, cu_q_lens, sc.cache,
                                                     sc.slots, sc.keep, eps=cfg.rms_norm_eps,
                                                     interpret=interpret, to_rows=False)
        out = jnp.einsum("thv,hve->te", normed, w_out)
        return on_rows(out, cu_q_lens, mixed.shape[0], out.dtype), conv, delta

    def output(self, normed, h):
        """normed [T, Hv, Dv] @ w_out -> [T, E] (a layers.Projected where h is a layers.Normed)."""
        if isinstance(h, layers.Normed):
            return layers.heads_projection(normed, self.w_out[...], h)
        return jnp.einsum("thv,hve->te", normed, self.w_out[...])

    def __call__(self, h, conv0, delta0, cu_q_lens, pos0, cfg, *, checkpoint_at=None,
                 impl=None, pieces=None, decode=None, seq_of_row=None, packing=None,
                 conv_idx=None, state_cache=None, one_row=None):
        """The GDN token mixer for a ragged batch.

        Args:
          h: [T, E] normed hidden states, or a layers.Normed (out: a layers.Projected where
            the kernels take it); conv0 [S, C, Kc-1], delta0 [S, Hv, Dk, Dv] (float32)
            the states of each sequence before its new tokens; cu_q_lens [S+1]; pos0 [S] position
            of each sequence's first new token; checkpoint_at None or [S, M] absolute positions
            (multiples of 64 or the sequence's end, -1 = none) or CheckpointRows (the same as K
            flat rows: checkpoints [K, ...]); impl: ragged kernel, a name of
            gated_delta.api ("xla", "pallas_fused", "mosaic", ...), that name + "_interpret"
            (its kernels in Pallas interpret mode, for CPU tests) or None / "auto": the kernel's
            policy (kernels_pallas.gated_delta.api.choose).
          pieces: None, qwen3_5_spans.SpanPieces or its `prepare` (computed once per step):
            SSEP span rows read a local pass (see there).
          decode: the step kind if the host knows it (True: RecurrentMetadata.decode's layout;
            False: any), None: decided on the device (gated_delta.api.ragged_gated_delta).
          seq_of_row: None or [T] int32 the sequence of each row (`rows_of_seqs`), packing:
            None or the flow prefill's gated_delta.ragged.packing, conv_idx: None or
            `conv_index(...)` (with checkpoint_at's): all three computed once per step; one_row:
            None or [S] bool, the sequences `packing` skips (qwen3_5.ONE_ROWS_IN_PLACE).
          state_cache: None, or on a decode step (no checkpoints, no pieces; delta0 unused) a
            StateCache: the layer's state cache, which gated_delta.api.ragged_decode_in_place
            steps in place (with `glue`, ragged_decode_layer_in_place: the l2 norms, gates and
            gated norm in the same kernel; with `conv`, ..._conv_layer_in_place: the causal conv
            too); `delta` is then the cache (and with `conv`, `conv` the conv cache).
        Returns:
          out [T, E], conv [S, C, Kc-1], delta [S, Hv, Dk, Dv], checkpoints (conv
          [S, M, C, Kc-1], delta [S, M, Hv, Dk, Dv]) or None, and the captured span maps
          (pieces.capture: qwen3_5_spans.captured_maps) or None.
        """
        kc, n_tokens = gdn_dims(cfg)[-1], h.shape[0]
        seq_of_row = rows_of_seqs(cu_q_lens, n_tokens) if seq_of_row is None else seq_of_row
        if conv_idx is None:
            conv_idx = conv_index(cu_q_lens, pos0, seq_of_row, kc - 1, checkpoint_at)
        if isinstance(pieces, SpanPieces):
            pieces = qwen3_5_spans.prepare(pieces, cu_q_lens, n_tokens, kc)
        if pieces is not None and "window_rows" not in pieces:
            pieces = qwen3_5_spans.with_windows(pieces, conv_idx["rows"], conv0.shape[0], kc - 1)
        (mixed, z, b, a), proj = self.projections(h, cfg)
        impl, interpret = interpreted(impl)
        if state_cache is not None and state_cache.glue:  # the layer's decode in one kernel
            out, conv, delta = self.decode_in_place(mixed, z, b, a, h.dtype, conv0, cu_q_lens,
                                                    pos0, seq_of_row, conv_idx, cfg,
                                                    state_cache, interpret, proj, h)
            return out, conv, delta, None, None
        q, k, v = self.conv_qkv(mixed, h.dtype, conv0, cu_q_lens, pos0, seq_of_row,
                                conv_idx["rows"], pieces, cfg)
        conv = read_history(mixed, conv0, conv_idx["end"]).astype(conv0.dtype)
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(self.a_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        kernel = dict(implementation=choose(impl, interpret=interpret), interpret=interpret)
        q, k = l2norm(q), l2norm(k)
        if state_cache is not None:  # a decode step, the states stepped in place in the cache
            core, delta = ragged_decode_in_place(q, k, v, g, beta, cu_q_lens, state_cache.cache,
                                                 state_cache.slots, state_cache.keep,
                                                 interpret=interpret)
            delta_ck = local_final = a_span = None
        else:
            core, delta, delta_ck, local_final, a_span = recurrent_core(
                (q, k, v, g, beta), cu_q_lens, pos0, delta0, pieces,
                checkpoint_at=checkpoint_at, decode=decode, packing=packing, one_row=one_row,
                seq_of_row=seq_of_row, **kernel)
        core = core.astype(h.dtype)  # [T, Hv, Dv]
        normed = gated_rms_norm(core, z, self.norm[...], cfg.rms_norm_eps)
        out = self.output(normed, h)
        maps = None
        if pieces is not None:  # (a cache written in place holds the carried finals already)
            conv, delta = qwen3_5_spans.carry_local(mixed, pieces, local_final, conv, delta,
                                                    written=isinstance(delta0, StateRows)
                                                    and delta0.write_final)
            if a_span is not None:
                maps = qwen3_5_spans.captured_maps(mixed, pieces, a_span, local_final)
        ckpt = None
        if checkpoint_at is not None:
            ckpt = (read_history(mixed, conv0, conv_idx["ckpt"]).astype(conv0.dtype), delta_ck)
        return out, conv, delta, ckpt, maps
