"""The warm path of SSEP spans on hybrid models: cached span maps (host bookkeeping, plain Python).

A span's effect on every recurrent layer is an affine map of the state plus a conv tail
(serving/hybrid/span_maps.py, docs/DESIGN.md section 5); like its attention blocks it depends on the
span's tokens only. So a span whose blocks are cached *and* whose map is stored is skipped
whole: its blocks are shared hits, and the chunk after it enters with the state composed from the
maps on device (`span_maps.enter`), for any number of spans in any order. A span computed in a
step has its map captured by that step (the model's local pass returns (A, B, tail) per piece).

  * Keys: the map of the span in blocks [j0, j1) is keyed by the hash of block j1 - 1 (an SSEP
    chain restarts at the span, so it covers exactly the span's tokens) and confirmed by that
    block's tokens, as blocks are.
  * Bookkeeping: a `CheckpointStore` (serving/hybrid/checkpoint_store.py) of map-sized entries: device
    slots of the map pool, an optional host tier (moves applied by the engine before the step),
    GreedyDual eviction valued by the span's tokens, pins from admission until the step that
    composes the map is launched.
  * Consistency: an entry lists its span's block hashes; when the device pool evicts one of them
    for good (no KV host tier), the map is dropped (`drop_dependent`). A request captures a map
    only where the span's blocks under their hashes are its own or ready (`_keyed`), so a map
    never outlives them by another way (a pending block dropped unready); a span the capture
    policy declined (span_capture.py) is captured by its next holder beside the first one's
    ready blocks. With a KV host tier the map stays while its blocks live on
    the host; a block the host tier drops leaves an unusable map to age out (as checkpoints).
  * Waiting: a request whose span another running request is computing right now (published,
    not ready) is not admitted until it is ready (it keeps its place; the scheduler may admit up
    to LOOK_PAST_WAITING requests behind it meanwhile): a few steps later it skips the span
    instead of computing it a second time beside it.
    The owner always progresses (a hybrid never shares a pending block), and a preempted owner
    unpublishes its pending blocks, so the wait ends.
  * Chunks: a chunk enters after the skipped spans between its frontier and its first row, and
    never runs past a later skipped span (`span_rows.cut_chunk` stops it there): the flow pass
    cannot apply a map between two rows of one step.
  * Only non-final spans are skipped or captured (the final segment is always computed).
  * Long spans (more tokens than a step takes) are computed and captured in pieces over several
    steps, their map so far held in their slot (serving/hybrid/span_partial.py).
  * Checkpoints (serving/hybrid/hybrid_prefix.py) in span prompts: only after a PDEP block, whose
    prefix-chain key covers every token before it (a span block's key restarts at the span), and
    not at a skipped span's start. A request resumes at the deepest one whose blocks below all
    hit, then skips the cached spans after it.
"""

from __future__ import annotations

import numpy as np

from serving.cache.admission import AdmissionPlan
from serving.cache.prefix_keys import device_run
from serving.hybrid import checkpoint_plan, span_partial, span_rows
from serving.hybrid.resume import Resume
from serving.hybrid.span_capture import CapturePolicy

MAX_CAPTURES = 8  # span maps one step may capture (a static shape of the runner's step)


class SpanMapCache:
    def __init__(self, store, block_size: int, pool=None, step_tokens: int = 1 << 62,
                 capture: str = "auto"):
        self.store, self.block_size = store, block_size
        self.capture = CapturePolicy(capture)  # which computed spans are captured
        self.pool = pool  # the device pool until the runner takes it
        self.step_tokens = step_tokens  # a longer non-final span goes in pieces (span_partial)
        self.captures = 0  # captures in the step being scheduled
        self.held, self.done, self.doomed = [], [], []  # long spans' slots (span_partial)
        self.spans_skipped = self.tokens_skipped = self.spans_captured = self.waits = 0

    def note(self, mgr, seq) -> None:
        """A span prompt was added to the engine: its non-final spans' keys are counted
        (span_capture: the queue is the capture policy's lookahead)."""
        bs = self.block_size
        hashes = mgr.keys.hashes(seq)
        self.capture.note(hashes[b // bs - 1] for a, b, final in span_rows.spans_of(seq, bs)
                          if not final and 0 < b // bs <= len(hashes))

    # -- admission -----------------------------------------------------------------------------
    def _span_hits(self, mgr, seq, a: int, b: int, matched=()):
        """[(kind, block)] for the span's blocks when every one is a ready device hit or in the
        KV host tier, else None. `matched`: the prompt's leading blocks known to be such
        (HybridPrefixCache.match's kinds): a span inside them is not looked up again."""
        bm, keys, bs = mgr.bm, mgr.keys, self.block_size
        j0, j1 = a // bs, b // bs
        if j1 <= len(matched):
            return list(matched[j0:j1])
        hashes = keys.hashes(seq)
        run, ready = device_run(bm, hashes[j0:j1], keys.token_bytes(seq), bs, offset=j0)
        if len(run) == j1 - j0:  # every block on the device and matching: checked as a whole
            return [("hit", blk) for blk in run] if ready == len(run) else None
        kinds = []  # a block elsewhere (the host tier?) or colliding: block by block
        for j in range(j0, j1):
            blk = bm.table.get(hashes[j])
            if blk is not None and bm.ready[blk] and bm.confirm[blk] == keys.confirm(seq, j):
                kinds.append(("hit", blk))
            elif blk is None and mgr.offload is not None and mgr.offload.contains(hashes[j]):
                kinds.append(("host", None))
            else:
                return None
        return kinds

    def _plan_skips(self, mgr, seq, start: int, matched=()):
        """[(a, b, entry)] spans at or after token `start` to skip (their map pinned), and
        {block: (kind, block)} of their blocks (`matched`: see _span_hits)."""
        keys, bs = mgr.keys, self.block_size
        hashes, limit = keys.hashes(seq), keys.hit_limit(seq)
        skips, plan = [], {}
        spans = span_rows.spans_of(seq, bs)
        # a long span it may compute needs a slot while its later skips are pinned: keep one
        pins = self.store.device_slots - any(
            not final and a >= start and span_rows.long_span(seq, a, b, self.step_tokens)
            for a, b, final in spans)
        for a, b, final in spans:
            if final or a < start or b // bs > limit or len(skips) >= pins:
                continue
            kinds = self._span_hits(mgr, seq, a, b, matched)
            if kinds is None:
                continue
            e = self.store.get(hashes[b // bs - 1], keys.confirm(seq, b // bs - 1))
            if e is None or not self.store.acquire(e):
                continue
            skips.append((a, b, e))
            plan.update({a // bs + i: k for i, k in enumerate(kinds)})
        return skips, plan

    def _in_flight(self, mgr, seq, start: int) -> bool:
        """A span of the prompt (at or after `start`) is being computed by a running request:
        its last block is published but not ready (its map may be reserved by the step being
        scheduled, which computes it)."""
        bm, keys, bs = mgr.bm, mgr.keys, self.block_size
        hashes, limit = keys.hashes(seq), keys.hit_limit(seq)
        for a, b, final in span_rows.spans_of(seq, bs):
            if final or a < start or b // bs > limit:
                continue
            blk = bm.table.get(hashes[b // bs - 1])
            if blk is not None and not bm.ready[blk] and bm.owner[blk] != -1:
                return True
        return False

    def plan_admission(self, mgr, seq, hybrid):
        """The plan of a span prompt on a hybrid model (`hybrid`: the HybridPrefixCache; None
        to wait): resume at the deepest checkpoint c whose blocks below all hit (its key a PDEP
        block's, which covers the whole prefix), skip the cached spans after c (their blocks
        shared or copied in from the KV host tier), every other block is new."""
        keys, bs = mgr.keys, self.block_size
        hashes = keys.hashes(seq)
        kinds, shared = hybrid.match(mgr, seq)
        kc, ck = hybrid.deepest(seq, hashes, keys.token_bytes(seq), len(kinds))
        if self._in_flight(mgr, seq, kc * bs):  # wait a step or two: it will be a hit
            if ck is not None:
                hybrid.store.release(ck)
            self.waits += 1
            return None
        skips, plan = self._plan_skips(mgr, seq, kc * bs, kinds)
        plan.update(enumerate(kinds[:kc]))
        return AdmissionPlan.from_kinds(seq.num_blocks_needed, plan, kc * bs,
                                        Resume(kinds, kc, shared, ck, skips))

    def commit(self, mgr, seq, r, hybrid) -> None:
        """The span admission planned as `r` took its blocks: the skipped spans' maps stay
        pinned until the step that composes them; the prompt's checkpoints are planned."""
        skips = r.skips
        self.spans_skipped += len(skips)
        self.tokens_skipped += sum(b - a for a, b, _ in skips)
        seq.span.skips = [(a, b) for a, b, _ in skips]
        seq.span.pins = {a: e for a, _, e in skips}  # until the step that composes them
        # planned before this admission is observed, as for plain prompts
        seq.hybrid.ck_positions, seq.hybrid.ck_values = self._checkpoints(
            hybrid, seq, mgr.keys.hashes(seq), r.shared)

    def _checkpoints(self, hybrid, seq, hashes, shared: int):
        """(positions, values) of the planned checkpoints of a span prompt that are exact and
        addressable: after a PDEP block (its key covers the whole prefix; a span block's does
        not), so never inside a span, and not at the start of a skipped span (the chunk there
        starts after its map)."""
        bs, lay = self.block_size, seq.layout
        skipped = {a for a, _ in seq.span.skips}

        def addressable(cand):  # the planner places its checkpoints among these only
            return ~lay.span_block[cand // bs - 1] & ~np.isin(cand, list(skipped))

        positions, values = hybrid.planner.prompt_plan(
            lay, seq.num_prompt_tokens, bs, hashes[:seq.num_prompt_tokens // bs], shared,
            allowed=addressable)
        if hybrid.planner.per_prompt and hybrid.planner.strategy != "none":
            positions, values = _with_span_start(hybrid, seq, positions, values, skipped)
        return positions, values

    def drop(self, seq) -> None:
        """The sequence leaves (preempted, finished, aborted): unpin maps it never entered, and
        discard a long span's half-captured map (span_partial: it recomputes the span)."""
        pins = seq.span.pins
        for e in (pins or {}).values():
            self.store.release(e)
        if pins:
            pins.clear()
        for p in seq.span.partial.values():
            self.held.remove(p)
            if not span_partial.discard(self.store, p):
                self.doomed.append(p)
        seq.span.partial.clear()

    # -- long spans ----------------------------------------------------------------------------
    def cut(self, seq, idx, frontier: int):
        """span_rows.cut_chunk, letting the chunk end inside a span when the step can capture
        its piece (a capture left, and a slot for a first piece) and the span is long, or at
        least span_rows.FILL_PIECE of its rows fit; a chunk that would continue a span in pieces
        with no capture left this step computes nothing."""
        part = seq.span.partial
        cont = bool(idx.size) and any(a < int(idx[0]) for a in part)
        if cont and self.captures >= MAX_CAPTURES:
            return idx[:0], seq.num_computed
        need = self.captures + cont + 1

        def split(a: int, b: int) -> bool:
            if a in part:
                return True
            if need > MAX_CAPTURES or not span_partial.slot_available(self.store):
                return False
            return (span_rows.long_span(seq, a, b, self.step_tokens)
                    or span_rows.valid_rows(seq, a, frontier) >= span_rows.FILL_PIECE)
        return span_rows.cut_chunk(seq, idx, frontier, self.block_size, split)

    def _long_caps(self, mgr, e, first: int) -> list:
        """Captures of the chunk's long-span pieces: the one it continues (from its first row)
        and the one it starts and leaves unfinished (`cut` made room for both)."""
        seq, caps, bs = e.seq, [], self.block_size
        for a, b, final in span_rows.spans_of(seq, bs):
            p = seq.span.partial.get(a)
            if p is not None and a < first < b:
                caps.append((first, p.entry.slot, 1))
                if b <= e.new_computed:  # its last piece: the map is whole after this step
                    del seq.span.partial[a]
                    self.held.remove(p)
                    self.done.append(p)
                    span_partial.finish(self.store, p)
                    self.spans_captured += 1
            elif not final and first <= a < e.new_computed < b:
                p = self._begin(mgr, seq, a, b)
                seq.span.partial[a] = p
                self.held.append(p)
                caps.append((a, p.entry.slot, 0))
        self.captures += len(caps)
        return caps

    def _begin(self, mgr, seq, a: int, b: int):
        """A slot for the long span [a, b): under its key when its blocks are this sequence's
        or ready (`_keyed`) and the key is free, else a private one (its rows need the state
        anyway)."""
        keys, bs = mgr.keys, self.block_size
        hashes = keys.hashes(seq)
        j0, j1 = a // bs, b // bs
        own = j1 <= len(hashes) and self._keyed(mgr, seq, hashes, j0, j1) and \
            not self.store.contains(hashes[j1 - 1])
        p = span_partial.begin(self.store, hashes[j1 - 1] if own else None,
                               keys.confirm(seq, j1 - 1) if own else b"",
                               hashes[j0:j1] if own else (), float(b - a))
        if p is None:  # `cut` saw a slot; nothing in between takes one
            raise RuntimeError(f"span-map cache: no slot for the long span at token {a} of "
                               f"sequence {seq.seq_id}")
        return p

    # -- chunks --------------------------------------------------------------------------------
    def annotate(self, mgr, e) -> None:
        """The chunk's chain (maps of the skipped spans before its first row, in order) and the
        spans it computes whole whose maps it captures."""
        seq = e.seq
        pins = seq.span.pins
        if pins is None:  # not a span prompt admitted here
            return
        first = int(e.token_idx[0]) if e.token_idx.size else e.new_computed
        chain = [a for a, b in seq.span.skips if seq.num_computed <= a and b <= first]
        e.map_chain = tuple(pins[a].slot for a in chain)
        for a in chain:
            self.store.hand_to_launch(pins.pop(a))
        if not e.token_idx.size:
            return
        long_caps = self._long_caps(mgr, e, first)
        caps, skipped = [], {a for a, _ in seq.span.skips} | {c[0] for c in long_caps}
        keys, bs = mgr.keys, self.block_size
        hashes = keys.hashes(seq)
        for a, b, final in span_rows.spans_of(seq, bs):
            if final or a in skipped or a < first or b > e.new_computed or \
                    b // bs > len(hashes) or self.captures >= MAX_CAPTURES or \
                    not self._keyed(mgr, seq, hashes, a // bs, b // bs) or \
                    not self.capture.worth(hashes[b // bs - 1]):
                continue
            j1 = b // bs
            slot = self.store.reserve(hashes[j1 - 1], keys.confirm(seq, j1 - 1), 0,
                                      hashes[a // bs:j1], float(b - a))
            if slot >= 0:
                caps.append((a, slot, 0))
                self.captures += 1
                self.spans_captured += 1
        e.map_caps = tuple(sorted(long_caps + caps))

    @staticmethod
    def _keyed(mgr, seq, hashes, j0: int, j1: int) -> bool:
        """Each of the sequence's blocks [j0, j1) is the one the block table holds under its hash,
        or the table's block for the hash is ready (its content is this block's, and lives as
        long as the key: a piece computed before a preemption, a span another request computed
        without capturing it). Only then does a map capture: a duplicate
        computed beside another request's pending blocks would outlive them when that request
        leaves before they are ready."""
        bm = mgr.bm
        for j in range(j0, j1):
            blk = bm.table.get(hashes[j])
            if bm.hash[seq.block_table[j]] != hashes[j] and not (
                    blk is not None and bm.ready[blk]
                    and bm.confirm[blk] == mgr.keys.confirm(seq, j)):
                return False
        return True

    def after_launch(self) -> None:
        self.store.after_launch()
        span_partial.after_launch(self.store, self.held, self.done, self.doomed)
        self.done, self.doomed = [], []
        self.captures = 0

    def stats(self) -> dict:
        s = self.store.stats()
        return {"span_maps_stored": s["checkpoints_stored"],
                "span_maps_evicted": s["checkpoints_evicted"],
                "span_maps_offloaded": s["checkpoints_offloaded"],
                "span_maps_onloaded": s["checkpoints_onloaded"],
                "span_map_bytes": s["checkpoint_bytes"],
                "span_map_device_slots": s["checkpoint_device_slots"],
                "span_map_host_slots": s["checkpoint_host_slots"],
                "span_maps_captured": self.spans_captured, "spans_skipped": self.spans_skipped,
                "span_maps_declined": self.capture.declined,
                "span_tokens_skipped": self.tokens_skipped, "span_admission_waits": self.waits}


def _with_span_start(hybrid, seq, positions, values, skipped):
    """The plan plus the first span's start (checkpoint_plan.first_span_start) while the
    checkpoint store has a free slot: a request reusing the spans in another order resumes
    there and skips them all, so its first step computes its question (issue 29); the planner's
    pmf may not pick it (off the chunk grid, or not where plain prefixes end). Not where a
    skipped span starts (`skipped`: its chunk starts after the map); the block before it is a
    PDEP one by first_span_start's rule. Its value: the logical tokens it saves next to the
    plan's shallower checkpoint."""
    p = checkpoint_plan.first_span_start(seq.layout, seq.num_prompt_tokens, hybrid.block_size)
    if p is None or p in positions or p in skipped or not hybrid.store.free_slots:
        return positions, values
    pos = checkpoint_plan.positions_of(seq.layout, [p] + [q for q in positions if q < p])
    order = sorted(zip(positions + [p], values + [float(pos[0] - max(pos[1:], default=0))]))
    return [q for q, _ in order], [v for _, v in order]


def build(config, family, mcfg, dtype, pool=None):
    """A SpanMapCache with its device pool (None when Config.span_maps.budget_gb is 0 or the family cannot
    read its states back). With `pool` (an engine's reset) that pool is kept."""
    import jax
    import jax.numpy as jnp
    from serving.hybrid import checkpoint_pool, span_maps
    from serving.hybrid.checkpoint_store import CheckpointStore
    if not config.span_maps.budget_gb and config.span_maps.budget_gb is not None or \
            not hasattr(family, "read_states"):
        return None
    lg, conv_shape, conv_dtype, delta_shape = checkpoint_pool.state_layout(
        family, mcfg, config.block_size, dtype)
    if lg == 0:
        return None
    (hv, dk, dv), (c, k1) = delta_shape, conv_shape
    state_dtype = jnp.dtype(span_maps.STATE_DTYPE)
    nbytes = span_maps.map_nbytes(hv, dk, dv, c, k1, lg, state_dtype=state_dtype,
                                  conv_dtype=conv_dtype)["total"]
    if config.span_maps.budget_gb is not None:
        slots = int(config.span_maps.budget_gb * (1 << 30)) // nbytes
    else:  # 2% of the device's memory limit, or 64 maps without memory stats
        try:
            limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
        except Exception:  # noqa: BLE001 - CPU backends may not report memory
            limit = None
        slots = int(0.02 * limit) // nbytes if limit else 64
    if slots <= 0:
        return None
    host = int(config.span_maps.host_gb * (1 << 30)) // nbytes
    if pool is None or pool.a.shape[0] < slots or pool.a.dtype != state_dtype:
        pool = span_maps.allocate(slots, lg, hv, dk, dv, c, k1, state_dtype=state_dtype,
                                  conv_dtype=conv_dtype)
    return SpanMapCache(CheckpointStore(slots, host, nbytes), config.block_size, pool,
                        config.max_num_batched_tokens - config.max_num_seqs,
                        config.span_maps.capture)
