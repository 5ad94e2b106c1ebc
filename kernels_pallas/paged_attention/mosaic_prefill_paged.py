"""The Mosaic GPU prefill kernel with no pre-pass: K and V read from the pages, keys rotated in SMEM.

mosaic_prefill.py's kernel reads keys from a contiguous per-sequence buffer that a pre-pass
(mosaic_prefill_prep.gather_kv; compiled, triton_gather.gather_live) fills with the live keys,
rotated by their logical positions in position_free mode. On the H200's cached-span step
(8 x 4096 cached keys, Llama-3.1-8B shapes) that pre-pass cost 1.45 ms of an ~11.5 ms step
(benchmarks/RESULTS.md, RAG headline). With `paged` (PagedOptions) the step has no pre-pass:

  * the memory warpgroup loads a key step's K like direct_v loads V: one TMA box [B, D] per page
    through the sequence's page table (in SMEM once per CTA), into the K ring slot;
  * in position_free mode, the step's cos | sin rows into one [BLOCK_KV, R] buffer: with
    cos_sin "keys" (default) one box of the rows XLA forms once per call for every key from
    its position (key_cos_sin, [S, N, R]: 17 MB for two 33K-key sequences); with "pages" one
    box per page from a table of positions kept in 8 copies shifted by 0..7 rows (mosaic_common's
    shifted_rope_table: a TMA box into tiled SMEM starts at a multiple of 8; a page's first
    position is arbitrary; the page starts sit in the table copy's second half of rows). The
    H100 call of 2026-12-05 measured that table's build at 0.042 ms a call (69 MB);
  * once the slot's boxes land (their own barrier, `raw_bar`), the memory warpgroup rotates the
    keys in place (rotate-half, 64 rows x R/2 columns per load; float32 or 16-bit math), fences
    its generic-proxy SMEM writes for the wgmma's async-proxy reads (plgpu.commit_smem:
    fence.proxy.async, PTX's proxy rule) and arrives on the slot's k_bar, which the compute
    warpgroups wait on as before; the same fence orders its reads of the cos | sin buffer before
    the next step's TMA refills it.

The memory warpgroup's order of waits and issues, an L2 prefetch of later steps' keys and the
option of a fourth warpgroup that does the rotation instead (PagedOptions.rotator) are
mosaic_prefill_paged_stream.py's (its docstring: why the first version, 1.41x slower than the
gather + contiguous kernel on the H100, lost, with the arithmetic).

The compute warpgroups are mosaic_prefill's, unchanged. Key positions and the tile schedule stay
in XLA (key_positions: [S, N] int32). The memory warpgroup's rotation needs registers: the
split between the compute and memory warpgroups is an option (the compiled kernel needs it
measured). The values' contract is direct_v's: every page slot holds finite values (keys of pad
slots may be anything: masked scores are replaced, not multiplied).

Limits (paged_limits): head_dim 128, bf16/f16, full rotary in position_free mode (R = D), page
size a multiple of 8 dividing BLOCK_KV, page table + starts within SMEM next to the ring.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.paged_attention.mosaic_common import META_COLS, SMEM_LIMIT, shifted_rope_table
from kernels_pallas.paged_attention.mosaic_prefill_paged_stream import (rotate_steps, step_pages,
                                                                        stream_pages)
from kernels_pallas.paged_attention.mosaic_prefill_prep import (
    BLOCK_KV, direct_v_limits, key_positions, page_table, queries_in, smem_bytes, tile_schedule)

_ROWS = 64  # key rows per rotation load (the WGMMA register layout's row tile)
COS_SIN = ("keys", "pages")  # PagedOptions.cos_sin


@dataclasses.dataclass(frozen=True)
class PagedOptions:
    """max_position: a bound on every position (the cos | sin table's rows; None: the table
    width x page size, i.e. max_model_len); registers: per-thread registers of each compute and
    of the memory warpgroup (the memory warpgroup rotates); packed: rotate in 16-bit math
    (bf16x2 / f16x2) instead of float32 (fewer registers, one rounding per product).
    cos_sin "keys": the cos | sin row of every key ([S, N, R], formed once per call from the
    key positions, as key_positions; one TMA box per key step; max_position unused); "pages":
    the shifted table (8 copies of max_position rows, ~69 MB at 33K positions, built per call)
    and one box per page. v_first: the memory warpgroup issues a step's values before it waits
    for the step's keys to land and rotates them (False: after; mosaic_prefill_paged_stream).
    prefetch: when a step's keys are issued, the pages (and cos | sin rows) of the step that
    many steps later are prefetched into L2 (0: none), so that step's wait is an L2 hit.
    rotator: None (the memory warpgroup rotates) or the per-thread registers (compute,
    memory, rotator) of a kernel with a fourth warpgroup that only rotates (it loads the cos |
    sin rows itself; cos_sin "keys"): the memory warpgroup then never waits for a landing.
    The defaults are the prediction of mosaic_prefill_paged_stream's arithmetic (keys first,
    their latency cut by the prefetch), not yet measured: benchmarks/runs/
    kernel_prefill_paged_next_device.sh sweeps them."""

    max_position: int | None = None
    registers: tuple[int, int] = (216, 72)
    packed: bool = False
    cos_sin: str = "keys"
    v_first: bool = False
    prefetch: int = 1
    rotator: tuple[int, int, int] | None = None

    def __post_init__(self):
        if self.cos_sin not in COS_SIN:
            raise ValueError(f"PagedOptions.cos_sin must be one of {COS_SIN}, got {self.cos_sin!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"PagedOptions.prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.rotator is not None:
            why = rotator_limits(self.rotator, self.cos_sin)
            if why:
                raise ValueError(f"PagedOptions.rotator={self.rotator!r}: {why}")


def rotator_limits(registers, cos_sin: str) -> str:
    """Why a fourth, rotating warpgroup cannot take these options ('' when it can)."""
    if cos_sin != "keys":
        return 'the rotating warpgroup loads its cos | sin rows itself: cos_sin must be "keys"'
    if len(registers) != 3 or any(r % 8 or not 24 <= r <= 256 for r in registers):
        return "needs 3 register counts (compute, memory, rotator), multiples of 8 in [24, 256]"
    if 2 * registers[0] + registers[1] + registers[2] > 512:  # 64K registers / 128 threads
        return "2 x compute + memory + rotator registers exceed 512 (64K per SM)"
    return ""


def paged_limits(head_dim: int, rotary_half: int, rotate_keys: bool, dtype, page_size: int,
                 table_cols: int, interpret: bool = False) -> str:
    """Why the paged variant cannot take these shapes ('' when it can)."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"paged keys need bf16/f16, got {jnp.dtype(dtype).name}"
    if head_dim != 128:
        return f"paged keys need head_dim 128, got {head_dim}"
    if rotate_keys and 2 * rotary_half != head_dim:
        return f"paged keys need full rotary (R = D) in position_free mode, got R={2 * rotary_half}"
    why = direct_v_limits(page_size, table_cols)
    if why:
        return f"paged keys: {why}"
    need = paged_smem_bytes(table_cols, page_size, jnp.dtype(dtype).itemsize, interpret)
    if need > SMEM_LIMIT:
        return (f"paged keys need {need} bytes of shared memory for {table_cols} table entries; "
                f"the H200 has {SMEM_LIMIT} per block")
    return ""


def paged_smem_bytes(table_cols: int, page_size: int, itemsize: int, interpret=False) -> int:
    """The kernel's SMEM plus the cos | sin buffer and the page table with its starts."""
    rows = _table_rows(table_cols, page_size)
    return smem_bytes(128, itemsize, interpret) + BLOCK_KV * 128 * itemsize + 2 * rows * META_COLS * 4


def _table_rows(table_cols: int, page_size: int) -> int:
    n_pad = -(-table_cols * page_size // BLOCK_KV) * BLOCK_KV
    return -(-(n_pad // page_size) // META_COLS)


@dataclasses.dataclass(frozen=True)
class PagedKeysSpec:
    """Host side of the paged keys: the rope table input and what the kernel binds."""
    rope: object  # cos | sin: [S, N, R] per key ("keys"), [8, P, R] shifted table ("pages"),
    # a [8, 8, R] stand-in in rotated mode
    rotate: bool
    page_size: int
    table_rows: int  # rows of page ids in the SMEM table (the starts follow)
    options: PagedOptions

    @property
    def rotator(self) -> bool:
        """Whether a fourth warpgroup rotates (PagedOptions.rotator, position_free mode)."""
        return self.rotate and self.options.rotator is not None

    @property
    def warpgroups(self) -> int:
        return 4 if self.rotator else 3

    def scratch(self, tiled, dtype, stages):
        """cos | sin rows of one key step, the slots' barriers for their raw boxes (with the
        cos | sin box unless the rotating warpgroup loads it, on its own barrier)."""
        pages = BLOCK_KV // self.page_size
        cos_sin_boxes = (0 if not self.rotate or self.rotator else
                         1 if self.options.cos_sin == "keys" else pages)
        return [plgpu.SMEM((BLOCK_KV, self.rope.shape[-1]), dtype, transforms=tiled)
                if self.rotate else None,
                plgpu.Barrier(num_arrivals=1 + pages + cos_sin_boxes, num_barriers=stages),
                plgpu.Barrier() if self.rotator else None]

    def bind(self, kernel, n_scratch: int):
        """mosaic_prefill._kernel taking the rope input (after the 8 inputs) and the key scratch
        (after its n_scratch entries), with `keys` bound to them; with a rotator, its fourth
        warpgroup's loop (mosaic_prefill_paged_stream.rotate_steps) after _kernel's three."""
        registers = self.options.rotator[:2] if self.rotator else self.options.registers

        def wrapped(*refs):
            ins, rope_ref, outs = refs[:8], refs[8], refs[9:11]
            scratch, (cs_smem, raw_bar, cs_bar) = refs[11:11 + n_scratch], refs[11 + n_scratch:]
            k_smem, kpos_smem, k_bar = scratch[1], scratch[3], scratch[10]
            keys = PagedKeys(ins[2], ins[4], rope_ref, k_smem, kpos_smem, cs_smem, k_bar,
                             raw_bar, self)
            kernel(*ins, *outs, *scratch, keys=keys, registers=registers)
            if self.rotator:
                rotate_steps(keys, ins[0], cs_bar, self.options.rotator[2])
        return wrapped


@dataclasses.dataclass(frozen=True)
class PagedKeys:
    """The memory warpgroup's key loads of one CTA (mosaic_prefill._kernel's `keys`)."""
    k_ref: object  # [P, B, K, D] pages
    kpos_ref: object  # [S, N] key positions
    rope_ref: object
    k_smem: object
    kpos_smem: object
    cs_smem: object
    k_bar: object
    raw_bar: object
    spec: PagedKeysSpec

    def issue(self, step, slot, seq, kv_head, tbl_smem, cos_sin: bool = True):
        """TMA loads of key step `step` into ring slot `slot`, all on raw_bar: key positions,
        per page its K box, and (position_free, unless cos_sin is False: issue_cos_sin later)
        the step's cos | sin rows."""
        size = self.spec.page_size
        keys = pl.ds(step * BLOCK_KV, BLOCK_KV)
        plgpu.copy_gmem_to_smem(self.kpos_ref.at[seq, keys], self.kpos_smem.at[slot],
                                self.raw_bar.at[slot])
        for j, page in enumerate(step_pages(tbl_smem, step, BLOCK_KV // size)):
            plgpu.copy_gmem_to_smem(self.k_ref.at[page, :, kv_head],
                                    self.k_smem.at[slot, pl.ds(j * size, size)],
                                    self.raw_bar.at[slot])
        if cos_sin:
            self.issue_cos_sin(step, slot, seq, tbl_smem)

    def prefetch(self, step, seq, kv_head, tbl_smem):
        """L2 prefetches (no SMEM, no barrier) of key step `step`'s pages and, cos_sin "keys",
        its cos | sin rows."""
        for page in step_pages(tbl_smem, step, BLOCK_KV // self.spec.page_size):
            plgpu.async_prefetch(self.k_ref.at[page, :, kv_head])
        if self.spec.rotate and self.spec.options.cos_sin == "keys":
            plgpu.async_prefetch(self.rope_ref.at[seq, pl.ds(step * BLOCK_KV, BLOCK_KV)])

    def issue_cos_sin(self, step, slot, seq, tbl_smem, bar=None):
        """The cos | sin rows of key step `step` into the one cos | sin buffer, on `bar` (None:
        the slot's raw_bar): one box ("keys") or one per page from the shifted table ("pages");
        nothing without rotation. The buffer must be free: the previous step's keys rotated."""
        spec, size = self.spec, self.spec.page_size
        if not spec.rotate:
            return
        if spec.options.cos_sin == "keys":
            plgpu.copy_gmem_to_smem(self.rope_ref.at[seq, pl.ds(step * BLOCK_KV, BLOCK_KV)],
                                    self.cs_smem, self.raw_bar.at[slot] if bar is None else bar)
            return
        starts = step_pages(tbl_smem, step, BLOCK_KV // size, spec.table_rows)  # clipped
        for j, start in enumerate(starts):
            shift = lax.rem(start, 8)
            src = self.rope_ref.at[shift, pl.ds(pl.multiple_of(start - shift, 8), size)]
            plgpu.copy_gmem_to_smem(src, self.cs_smem.at[pl.ds(j * size, size)],
                                    self.raw_bar.at[slot])

    def stream(self, **refs):
        """The whole memory warpgroup: K and V from the pages in PagedOptions.v_first's order
        (mosaic_prefill_paged_stream.stream_pages; refs: its keyword arguments)."""
        stream_pages(self, **refs)

    def finish(self, slot):
        """Once the slot's boxes land: rotate its keys in place, fence, arrive on k_bar."""
        plgpu.barrier_wait(self.raw_bar.at[slot])
        if self.spec.rotate:
            self._rotate(self.k_smem.at[slot])
        # generic-proxy writes (the rotated keys) and reads (the cos | sin rows) before the
        # async proxy's wgmma reads and TMA refills: fence.proxy.async (PTX's proxy rule)
        plgpu.commit_smem()
        plgpu.barrier_arrive(self.k_bar.at[slot])

    def _rotate(self, k):
        half = k.shape[-1] // 2
        dtype = k.dtype
        math = dtype if self.spec.options.packed else jnp.float32
        layout = plgpu.Layout.WGMMA
        for r in range(BLOCK_KV // _ROWS):
            rows = pl.ds(r * _ROWS, _ROWS)
            lo_ref, hi_ref = k.at[rows, pl.ds(0, half)], k.at[rows, pl.ds(half, half)]
            cos = plgpu.load(self.cs_smem.at[rows, pl.ds(0, half)], layout=layout).astype(math)
            sin = plgpu.load(self.cs_smem.at[rows, pl.ds(half, half)], layout=layout).astype(math)
            lo = plgpu.load(lo_ref, layout=layout).astype(math)
            hi = plgpu.load(hi_ref, layout=layout).astype(math)
            lo_ref[...] = (lo * cos - hi * sin).astype(dtype)
            hi_ref[...] = (hi * cos + lo * sin).astype(dtype)


def key_cos_sin(key_pos, inv_freq, attention_scaling: float, dtype):
    """[S, N] key positions -> [S, N, R] cos | sin rows (rope_table_in_graph's float32 angle,
    so the same values; a pad slot's sentinel position gives some finite row: its keys are
    masked): what the cos_sin="keys" kernel reads, one box per key step. One elementwise
    fusion writing 2 x R bytes a key (17 MB for two 33K-key sequences), formed once per step
    (the layers' copies are the same graph); the shifted table it replaces was 8 x
    max_position rows (69 MB at 33K)."""
    ang = key_pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return (jnp.concatenate([jnp.cos(ang), jnp.sin(ang)], axis=-1) * attention_scaling).astype(dtype)


def paged_prepare(q_rot, k_pages, v_pages, md, inv_freq, options: PagedOptions, *, rotate_keys: bool,
                  attention_scaling: float, sm_scale: float):
    """Everything before the kernel without a pre-pass -> (run_kernel's inputs, PagedKeysSpec):
    the page pools themselves for k and v, the page table ([S, R, 64] page ids, clipped; with
    cos_sin "pages" each entry's first position after them: [S, 2R, 64]), key positions, the
    tile schedule, the padded queries; in position_free mode the cos | sin rows (key_cos_sin,
    or the shifted table)."""
    tokens = q_rot.shape[0]
    num_pages, page_size, _, head_dim = k_pages.shape
    seqs, cols = md.block_tables.shape
    why = paged_limits(head_dim, inv_freq.shape[0], rotate_keys, q_rot.dtype, page_size, cols)
    if why:
        raise ValueError(why)
    n_pad = -(-cols * page_size // BLOCK_KV) * BLOCK_KV
    key_pos = key_positions(md, page_size, n_pad)
    pages = page_table(md, num_pages, page_size, n_pad)  # [S, R, 64]
    rows = pages.shape[1]
    rotate = rotate_keys and inv_freq.shape[0] > 0
    starts = None
    if rotate and options.cos_sin == "keys":
        rope = key_cos_sin(key_pos, inv_freq, attention_scaling, q_rot.dtype)
    elif rotate:
        bound = options.max_position or cols * page_size
        rope = shifted_rope_table(inv_freq, bound + page_size, attention_scaling, q_rot.dtype)
        starts = jnp.clip(md.block_pos_start.astype(jnp.int32), 0, rope.shape[1] - page_size)
    else:
        rope = jnp.zeros((8, 8, head_dim), q_rot.dtype)  # unread
    table = pages
    if starts is not None:  # each entry's first position, the rows after the page ids
        starts = jnp.pad(starts, ((0, 0), (0, rows * META_COLS - cols))).reshape(seqs, rows, -1)
        table = jnp.concatenate([pages, starts], axis=1)
    sched = tile_schedule(md, key_pos, tokens)
    q_in, q_pos, q_win = queries_in(q_rot, md, sm_scale)
    inputs = (sched, q_in, k_pages, v_pages, key_pos, q_pos, q_win, table)
    return inputs, PagedKeysSpec(rope, rotate, page_size, rows, options)
