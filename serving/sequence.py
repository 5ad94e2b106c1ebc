"""One request as the engine sees it: tokens, layout, blocks, progress, timing."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time

import numpy as np

from serving.layout import PromptLayout


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


_ids = itertools.count()

# Stands in token_ids for a token sampled by a step still in flight (async scheduling): counted in
# every length and block quantity like a real token; its value lives on the device until read.
PLACEHOLDER = -1
_EMPTY = np.zeros(0, np.int64)


def _ints(x) -> list:
    """Plain Python ints (numpy scalars convert slowly when copied into the step's rows)."""
    return x.tolist() if isinstance(x, np.ndarray) else list(x)


@dataclasses.dataclass(slots=True)
class HybridState:
    """Hybrid prefix cache (serving/hybrid/hybrid_prefix.py): the prompt's planned checkpoints and the
    checkpoint its first chunk resumes from."""
    ck_positions: list = dataclasses.field(default_factory=list)  # token indices, ascending
    ck_values: list = dataclasses.field(default_factory=list)  # each checkpoint's value
    # candidates off the plan -> value: a chunk may take one while the store has free slots
    ck_free: dict = dataclasses.field(default_factory=dict)
    # free candidates a chunk also takes while the store has free slots (HybridPrefixCache.commit)
    ck_cuts: list = dataclasses.field(default_factory=list)
    ck_waits: int = 0  # admissions deferred to wait for another sequence's checkpoint
    restore_entry: object = None  # checkpoint-store entry, until the chunk that restores it


@dataclasses.dataclass(slots=True)
class SpanState:
    """SSEP spans (serving/hybrid/span_cache.py, span_jobs.py): cached spans the warm path skips."""
    skips: list = dataclasses.field(default_factory=list)  # (start, end) token indices
    # span start -> pinned map entry, until the step that composes it; None: not a span prompt
    # admitted through the span-map cache
    pins: dict | None = None
    # span start -> span_partial.Partial: a long span whose map this sequence is capturing in
    # pieces (serving/hybrid/span_partial.py), until its last piece's step
    partial: dict = dataclasses.field(default_factory=dict)
    jobs_scanned: bool = False  # its span jobs were made (isps: once per request)


@dataclasses.dataclass(slots=True)
class StoreState:
    """KV store tier (serving/tiers/kv_store_tier.py): reads started for this waiting request."""
    scanned: bool = False  # prefetch looked it up in the store (once)
    wants: list = dataclasses.field(default_factory=list)  # block-hash runs being read for it


@dataclasses.dataclass(slots=True)
class Memos:
    """Values derived from the tokens or the layout, kept by the module that derives them
    (None until first asked)."""
    token_bytes: bytes | None = None  # serving/cache/prefix_keys.py
    span_runs: list | None = None  # (first, end, keys) block runs of its spans: prefix_keys.py
    final_start: int | None = None  # serving/scheduler.py
    span_intervals: list | None = None  # serving/hybrid/span_rows.py
    has_spans: bool | None = None  # serving/hybrid/span_step.py
    # (block_table list, int64 array of its head): Sequence.table_array
    table_array: tuple | None = None
    # the block_table list known to hold no block twice: serving/cache/manager.py
    distinct_table: list | None = None


class Sequence:
    """Prompt + generated tokens. `num_computed` is a token index (pads included): every token
    before it has its K/V in the cache (computed here, or a ready cache hit).

    Slotted: every field is declared here (STYLE 14); assigning any other attribute raises."""

    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "layout",
        "sampling_params", "block_size", "seed", "cache_salt", "is_span_job", "status",
        "block_table", "block_hashes", "chain_tail", "num_computed", "num_cached_tokens",
        "owned", "seat", "synced_blocks", "needs_reset", "ever_admitted", "ready_ptr",
        "finish_reason", "stop_reason", "text_end", "prompt_text", "stop_text",
        "output_logprobs", "cum_logprob", "arrival_time", "first_scheduled_time",
        "first_token_time", "finished_time", "num_preemptions", "num_pending",
        "ends_with_pending", "tail_block", "tail_valid", "tail_pos_start", "num_valid",
        "hybrid", "span", "store", "memo")

    def __init__(self, request_id, prompt_token_ids, layout: PromptLayout, sampling_params,
                 block_size: int, *, seed: int, cache_salt: str | None = None,
                 is_span_job: bool = False, arrival_time: float | None = None,
                 own_ids: bool = False):
        """`own_ids`: `prompt_token_ids` is a list no one else holds (LLM.generate's own), kept
        as token_ids instead of copied (a 33K-token prompt's copy is ~0.1 ms of its TTFT)."""
        self.seq_id = next(_ids)
        self.request_id = request_id
        # the prompt's ids never change (prompt_token_ids); generated ones are appended
        self.token_ids = (prompt_token_ids if own_ids and type(prompt_token_ids) is list
                          else list(prompt_token_ids))
        self.num_prompt_tokens = len(self.token_ids)
        self.layout = layout
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.seed = seed
        self.cache_salt = cache_salt
        self.is_span_job = is_span_job
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] | None = None  # full prompt blocks, then generated ones
        self.chain_tail: tuple[int, int] | None = None  # hash chains after the last key
        self.num_computed = 0
        self.num_cached_tokens = 0  # prompt tokens served from the cache (first admission)
        self.owned: set[int] = set()  # blocks this sequence computes (and publishes)
        self.seat = -1  # batch row / recurrent-state slot while running
        self.synced_blocks = 0  # block-table entries already copied to the runner's host rows
        self.needs_reset = True  # recurrent state starts from zero on the next chunk
        self.ever_admitted = False
        self.ready_ptr = 0  # prefix blocks known ready (cache hits another sequence computes)
        self.finish_reason: str | None = None
        self.stop_reason = None  # the stop token id or stop string that ended the request
        self.text_end: int | None = None  # output text cut here (a stop string), else None
        self.prompt_text: str | None = None  # the prompt as given, when it was text
        self.stop_text = ""  # output text decoded at the last stop-string check
        self.output_logprobs: list = []
        self.cum_logprob = 0.0
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.num_pending = 0  # trailing PLACEHOLDER tokens (0 or 1: one step in flight at most)
        # async: finished (blocks and seat freed) because its pending token reaches the length
        # limit, whatever its value; the token is still read back and reported
        self.ends_with_pending = False
        # Block-level layout over all tokens (prompt blocks, then generated ones): the layout's
        # arrays up to the prompt's last block, which generated tokens may fill, and from there
        # these lists (a cached 33K-token prompt's 2,000 blocks are not made lists)
        self.tail_block = max(len(layout.block_valid) - 1, 0)
        self.tail_valid = _ints(layout.block_valid[self.tail_block:])
        self.tail_pos_start = _ints(layout.block_pos_start[self.tail_block:])
        self.num_valid = layout.num_valid
        self.hybrid = HybridState()
        self.span = SpanState()
        self.store = StoreState()
        self.memo = Memos()

    # -- sizes ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """A new list of the prompt's ids (the head of token_ids: only generated tokens are
        appended, resolved or dropped)."""
        return self.token_ids[:self.num_prompt_tokens]

    def hand_over_prompt_ids(self) -> list[int]:
        """The prompt's ids for the output of a finished sequence: token_ids itself, cut to
        the prompt (a list only this sequence holds: a 33K-token prompt's copy was ~40 us of a
        cached span request), so read its output ids first. The sequence is done with its
        tokens: nothing reads them after its output is made (LLMEngine drops it)."""
        if not self.is_finished:
            raise RuntimeError(f"request {self.request_id!r}: its prompt ids are handed over "
                               f"only once it has finished")
        ids = self.token_ids
        del ids[self.num_prompt_tokens:]
        return ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks_needed(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    @property
    def num_counted_blocks(self) -> int:
        """Blocks holding tokens: entries of the block-level layout (prompt, then generated)."""
        return self.tail_block + len(self.tail_valid)

    def block_valid_at(self, j: int) -> int:
        """Valid tokens in block j (< num_counted_blocks)."""
        return self.tail_valid[j - self.tail_block] if j >= self.tail_block else \
            int(self.layout.block_valid[j])

    def block_pos_starts(self) -> np.ndarray:
        """[num_counted_blocks] int32: the logical position of each block's first slot."""
        head = self.layout.block_pos_start[:self.tail_block]
        return np.concatenate([head, np.asarray(self.tail_pos_start, np.int32)]).astype(np.int32)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append_token(self, token: int) -> None:
        """A generated token: always valid, takes the next logical position, extends the last
        segment (its window start is the layout's last_win)."""
        i = len(self.token_ids) // self.block_size - self.tail_block
        if i == len(self.tail_valid):
            self.tail_valid.append(0)
            self.tail_pos_start.append(self.num_valid)
        self.tail_valid[i] += 1
        self.token_ids.append(token)
        self.num_valid += 1

    def append_placeholder(self) -> None:
        """The token a dispatched step samples, before its value is read back."""
        self.append_token(PLACEHOLDER)
        self.num_pending += 1

    def drop_placeholder(self) -> None:
        """Undo `append_placeholder` (its step was lost): the token will be sampled again."""
        self.token_ids.pop()
        self.num_pending -= 1
        self.num_valid -= 1
        blk = len(self.token_ids) // self.block_size
        i = blk - self.tail_block
        self.tail_valid[i] -= 1
        if (self.tail_valid[i] == 0 and i == len(self.tail_valid) - 1
                and blk >= len(self.layout.block_valid)):
            self.tail_valid.pop()
            self.tail_pos_start.pop()

    def resolve_placeholder(self, token: int) -> None:
        """The pending last token's value, read back from its step."""
        self.token_ids[-1] = token
        self.num_pending -= 1

    @property
    def will_finish_by_length(self) -> bool:
        """The pending token reaches max_tokens (whatever its value): no more decodes."""
        mt = self.sampling_params.max_tokens
        return mt is not None and len(self.token_ids) - self.num_prompt_tokens >= mt

    def stop_check(self, tok: int, eos_ids, max_model_len: int) -> str | None:
        """After appending sampled token `tok`: "stop" (a stop token, or EOS unless ignore_eos,
        once min_tokens are out; sets stop_reason for stop tokens), "length" (max_tokens or
        max_model_len reached) or None."""
        sp = self.sampling_params
        n_tok = len(self.token_ids)
        n_out = n_tok - self.num_prompt_tokens
        if n_out >= sp.min_tokens and (tok in eos_ids or tok in sp.stop_token_ids):
            if tok in sp.stop_token_ids:
                self.stop_reason = tok
                return "stop"
            if not sp.ignore_eos:
                return "stop"
        if (sp.max_tokens is not None and n_out >= sp.max_tokens) or n_tok >= max_model_len:
            return "length"
        return None

    def table_array(self) -> np.ndarray:
        """`block_table` as an int64 array (read-only), each entry converted once: a block
        table is only appended to or replaced by a new list, so the array of a list's head
        stays valid while that list is the table. A cached 33K-token request's ~2,000 entries
        are read as an array by its chunk plan, its seat's rows and its release."""
        table, memo = self.block_table, self.memo.table_array
        n = len(table)
        valid = memo is not None and memo[0] is table and memo[1].size <= n  # a shrunk list: anew
        arr = memo[1] if valid else _EMPTY
        k = arr.size
        if k < n:
            arr = np.concatenate([arr, np.fromiter(table[k:], np.int64, n - k)]) if k else \
                np.fromiter(table, np.int64, n)
            arr.flags.writeable = False
            self.memo.table_array = (table, arr)
        return arr

    # -- per-token geometry for a range of token indices ----------------------------------------
    def geometry(self, idx: np.ndarray):
        """idx [n] token indices -> (pos, win, slot_off, is_pad), each [n]."""
        lay, n_p = self.layout, self.num_prompt_tokens
        if idx.size and idx[-1] < n_p:
            return lay.pos_at(idx), lay.win_at(idx), lay.slot_off_at(idx), lay.is_pad[idx]
        gen = idx >= n_p
        pi = np.minimum(idx, max(n_p - 1, 0))
        pos = np.where(gen, lay.num_valid + (idx - n_p), lay.pos_at(pi))
        win = np.where(gen, lay.last_win, lay.win_at(pi))
        # generated tokens sit in the prompt's last block or later: only the tail's starts are
        # read (the clamped index of a prompt token is masked below)
        blk = np.maximum(idx // self.block_size - self.tail_block, 0)
        bps = np.asarray(self.tail_pos_start, np.int32)[blk]
        slot = np.where(gen, pos - bps, lay.slot_off_at(pi))
        pad = np.where(gen, False, lay.is_pad[pi])
        return (pos.astype(np.int32), win.astype(np.int32), slot.astype(np.int32),
                pad.astype(bool))
