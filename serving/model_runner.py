"""Runs one engine step on device: host metadata -> one jitted (forward + sample) call.

Per step the host packs every int input (tokens, attention metadata, recurrent slots, logits rows,
sampling ints) into one int32 buffer and the float sampling inputs into one float32 buffer, so a
step is one dispatch with two transfers in and one device_get out (the only host sync). Shapes
are bucketed by `Config.token_buckets` (see serving/config.py); the KV cache is donated.
Block-table rows live in host arrays indexed by seat and are updated incrementally.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.paged_attention.metadata import AttentionMetadata
from minipic_jax.models.interface import RecurrentMetadata
from serving.sampler import SamplingMetadata, sample

_T_FIELDS = ("tokens", "q_positions", "q_window_start", "q_seq", "slot_mapping")
_S_FIELDS = ("num_blocks", "logits_indices", "state_slots", "reset", "top_k", "seed", "step")
_SB_FIELDS = ("block_tables", "block_pos_start", "block_num_valid")


def _layout(t: int, s: int, nb: int):
    """Static offsets of each field in the packed int32 buffer."""
    spec, off = {}, 0
    for f in _T_FIELDS:
        spec[f] = (off, (t,))
        off += t
    spec["cu_q_lens"] = (off, (s + 1,))
    off += s + 1
    for f in _S_FIELDS:
        spec[f] = (off, (s,))
        off += s
    for f in _SB_FIELDS:
        spec[f] = (off, (s, nb))
        off += s * nb
    return spec, off


class ModelRunner:
    def __init__(self, config, loaded, num_blocks: int, dtype):
        self.config = config
        self.family = loaded.family
        self.mcfg = loaded.cfg
        self.params = loaded.params
        self.block_size = config.block_size
        self.nb = config.max_blocks_per_seq
        self.num_blocks = num_blocks
        seats = config.num_seats
        self.scratch_slot = seats  # recurrent slot for padding rows
        self.cache = self.family.init_cache(self.mcfg, num_blocks, config.block_size, seats + 1,
                                            dtype)
        self.kv_mode = "rotated" if config.kv_mode == "rotated" else "position_free"
        self.h_tables = np.zeros((seats, self.nb), np.int32)
        self.h_pos_start = np.zeros((seats, self.nb), np.int32)
        self.h_valid = np.zeros((seats, self.nb), np.int32)
        self._step = jax.jit(self._step_impl, donate_argnums=(1,),
                             static_argnames=("t", "s", "all_greedy", "use_filter", "num_logprobs"))

    @property
    def num_compiles(self) -> int:
        return self._step._cache_size()

    # -- device --------------------------------------------------------------------------------
    def _step_impl(self, params, cache, ints, floats, *, t, s, all_greedy, use_filter,
                   num_logprobs):
        spec, _ = _layout(t, s, self.nb)
        f = {k: jax.lax.dynamic_slice_in_dim(ints, o, int(np.prod(shape))).reshape(shape)
             for k, (o, shape) in spec.items()}
        md = AttentionMetadata(
            q_positions=f["q_positions"], q_window_start=f["q_window_start"], q_seq=f["q_seq"],
            cu_q_lens=f["cu_q_lens"], num_blocks=f["num_blocks"], block_tables=f["block_tables"],
            block_pos_start=f["block_pos_start"], block_num_valid=f["block_num_valid"],
            slot_mapping=f["slot_mapping"])
        rec = RecurrentMetadata(state_slots=f["state_slots"], reset=f["reset"] > 0)
        logits, cache = self.family.forward(
            params, f["tokens"], md, cache, self.mcfg, recurrent=rec,
            logits_indices=f["logits_indices"], kv_mode=self.kv_mode,
            attn_impl=self.config.attn_impl)
        sm = SamplingMetadata(temperature=floats[:s], top_k=f["top_k"], top_p=floats[s:],
                              seed=f["seed"].astype(jnp.uint32), step=f["step"])
        out = sample(logits, sm, all_greedy=all_greedy, use_filter=use_filter,
                     num_logprobs=num_logprobs)
        return cache, out

    def warmup(self, *, all_greedy: bool = True, use_filter: bool = False,
               num_logprobs: int = 0) -> None:
        """Compile every token bucket for one sampling mode with empty steps (nothing written)."""
        for t in self.config.token_buckets:
            s = self.config.seq_bucket(t)
            spec, size = _layout(t, s, self.nb)
            ints = np.zeros(size, np.int32)
            o, (n,) = spec["slot_mapping"]
            ints[o:o + n] = -1
            o, (n,) = spec["state_slots"]
            ints[o:o + n] = self.scratch_slot
            floats = np.ones(2 * s, np.float32)
            self.cache, out = self._step(self.params, self.cache, ints, floats, t=t, s=s,
                                         all_greedy=all_greedy, use_filter=use_filter,
                                         num_logprobs=num_logprobs)
            jax.block_until_ready(out)

    # -- host ----------------------------------------------------------------------------------
    def _sync_rows(self, seq) -> None:
        seat, k = seq.seat, getattr(seq, "synced_blocks", 0)
        n = min(len(seq.block_table), len(seq.block_valid))
        if k < n:
            self.h_tables[seat, k:n] = seq.block_table[k:n]
            self.h_pos_start[seat, k:n] = seq.block_pos_start[k:n]
            self.h_valid[seat, k:n] = seq.block_valid[k:n]
            seq.synced_blocks = n
        if n:
            self.h_valid[seat, n - 1] = seq.block_valid[n - 1]

    def run(self, batch, *, num_logprobs: int = 0, timer=None):
        """Execute one scheduled batch. Returns host numpy outputs (rows = batch order)."""
        cfg, bs = self.config, self.block_size
        real = sum(e.token_idx.size for e in batch)
        t = cfg.token_bucket(max(real, 1))
        s = cfg.seq_bucket(t)
        spec, size = _layout(t, s, self.nb)
        ints = np.zeros(size, np.int32)
        v = {k: ints[o:o + int(np.prod(shape))].reshape(shape) for k, (o, shape) in spec.items()}
        floats = np.ones(2 * s, np.float32)
        floats[:s] = 0.0
        v["slot_mapping"][:] = -1
        v["state_slots"][:] = self.scratch_slot
        sampling = []
        row = 0
        seats = np.zeros(len(batch), np.int64)
        for i, e in enumerate(batch):
            seq, idx = e.seq, e.token_idx
            n = idx.size
            self._sync_rows(seq)
            seats[i] = seq.seat
            last = int(idx[-1]) if n else e.new_computed - 1
            if n == 1 and last >= seq.num_prompt_tokens:  # decode fast path
                v["tokens"][row] = seq.token_ids[last]
                p = seq.layout.num_valid + (last - seq.num_prompt_tokens)
                v["q_positions"][row] = p
                v["q_window_start"][row] = seq.layout.last_win
                j = last // bs
                v["slot_mapping"][row] = (seq.block_table[j] * bs + p - seq.block_pos_start[j])
            elif n:
                lo = int(idx[0])
                toks = np.asarray(seq.token_ids[lo:last + 1], np.int32)
                v["tokens"][row:row + n] = toks[idx - lo]
                pos, win, off, _ = seq.geometry(idx)
                v["q_positions"][row:row + n] = pos
                v["q_window_start"][row:row + n] = win
                tbl = np.asarray(seq.block_table[lo // bs:last // bs + 1], np.int32)
                v["slot_mapping"][row:row + n] = tbl[idx // bs - lo // bs] * bs + off
            v["q_seq"][row:row + n] = i
            row += n
            v["cu_q_lens"][i + 1] = row
            v["num_blocks"][i] = last // bs + 1 if last >= 0 else 0
            v["state_slots"][i] = seq.seat
            v["reset"][i] = e.reset
            if e.sample:
                sp = seq.sampling_params
                v["logits_indices"][i] = row - 1
                v["top_k"][i] = sp.top_k if sp.top_k and sp.top_k > 0 else 0
                v["seed"][i] = seq.seed & 0x7FFFFFFF
                v["step"][i] = seq.num_output_tokens
                floats[i] = sp.temperature
                floats[s + i] = sp.top_p
                sampling.append(sp)
        v["cu_q_lens"][len(batch) + 1:] = row
        n_seq = len(batch)
        v["block_tables"][:n_seq] = self.h_tables[seats]
        v["block_pos_start"][:n_seq] = self.h_pos_start[seats]
        v["block_num_valid"][:n_seq] = self.h_valid[seats]
        all_greedy = all(sp.temperature == 0 for sp in sampling)
        use_filter = any(sp.temperature > 0 and ((sp.top_k or 0) > 0 or sp.top_p < 1)
                         for sp in sampling)
        self.cache, out = self._step(self.params, self.cache, ints, floats, t=t, s=s,
                                     all_greedy=all_greedy, use_filter=use_filter,
                                     num_logprobs=num_logprobs)
        t0 = time.perf_counter()
        out = jax.device_get(out)  # the step's one host sync
        if timer is not None:
            timer[0] = time.perf_counter() - t0
        return out
