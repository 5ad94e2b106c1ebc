"""The recurrent-checkpoint store of a hybrid model (host bookkeeping; plain Python over ints).

A checkpoint is the conv + delta state of every recurrent layer of one sequence after token c. It
is keyed by the prefix-chain hash of block c/B - 1 and confirmed by that block's tokens, as blocks
are: the attention blocks below c hit only when their own tokens match, and a restore needs them
all (c <= matched depth), so a checkpoint serves exactly the requests whose first c tokens match.

Two tiers, each holding whole checkpoints of `nbytes` bytes (exact: serving/hybrid/checkpoint_pool.py):
  * device: `device_slots` slots of one preallocated pool (Config.hybrid_cache.budget_gb), LRU;
  * host: `host_slots` numpy copies (part of Config.cpu_offload_gb); a device checkpoint the LRU
    evicts moves here when there is room, and comes back into a device slot on a hit.
Moves are recorded here and carried out by the engine before the step that needs them (one gather
out, then one scatter in, then the step, in device program order).

Device eviction is GreedyDual: an entry's priority is the clock L plus its value (expected prompt
tokens it saves a later request, from the prompt's plan pmf: serving/hybrid/checkpoint_plan.py), set when
it is stored and on every hit (where the caller may `revalue` it: serving/hybrid/hybrid_prefix.py); the
unpinned entry of lowest priority goes (least recently used first
among equals) and L rises to its priority, so unused entries age out whatever their value. With
all values equal this is LRU. Under a tight budget it keeps a prompt's deep checkpoint (the one
most later requests resume from) over its shallow ones, where LRU would drop the oldest prompt's
whole chain.

Pins keep a slot's content in place while someone needs it: a sequence admitted to restore from
an entry pins it until the step that reads it has been launched; an entry being written by the
next step is pinned until that step is launched (evicting it before would copy garbage out).

An entry is restorable (`get` finds it) only once the step that writes it has been launched.
The step reads its restore rows before the model runs and writes its checkpoints after, so a
request admitted later in the same schedule that resumed from an entry reserved by that schedule
would read the slot's previous contents (another checkpoint, or zeros). Launched, the write
precedes every later step's read (the pool is threaded through the steps in program order).

Eviction stays consistent with the block manager: an entry lists the block hashes below it, and
when the device pool evicts one of those blocks (and no KV host tier keeps it), the entries above
it are dropped; they could never be restored again.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(eq=False)
class Entry:
    key: int
    confirm: bytes
    position: int  # logical position of the state (valid tokens before c)
    deps: tuple  # block hashes below c
    slot: int = -1  # device slot, -1 when on the host
    host: tuple | None = None  # (HostBatch, row) when on the host
    pins: int = 0
    value: float = 0.0  # expected tokens saved per request (GreedyDual)
    priority: float = 0.0
    written: bool = True  # False from `reserve` until the step that writes it is launched


class CheckpointStore:
    def __init__(self, device_slots: int, host_slots: int, nbytes: int):
        self.device_slots, self.host_slots, self.nbytes = device_slots, host_slots, nbytes
        self.device: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # LRU
        self.host: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self.free_slots = list(range(device_slots))[::-1]
        self.deps: dict[int, set[int]] = collections.defaultdict(set)
        self.moves_out: list[tuple[int, Entry]] = []  # (device slot, entry) copied to host
        self.moves_in: list[tuple[int, Entry]] = []  # (device slot, entry) copied from host
        self.launch_pins: list[Entry] = []
        self.writing: list[Entry] = []  # reserved for the step being scheduled
        self.clock = 0.0  # GreedyDual's L
        self.num_stored = self.num_evicted = self.num_offloaded = self.num_onloaded = 0

    # -- lookups -------------------------------------------------------------------------------
    def get(self, key: int, confirm: bytes) -> Entry | None:
        e = self.device.get(key) or self.host.get(key)
        if e is None or e.confirm != confirm or not e.written:
            return None  # a hash collision is a miss; so is a state not written yet
        return e

    def contains(self, key: int) -> bool:
        return key in self.device or key in self.host

    # -- restore -------------------------------------------------------------------------------
    def acquire(self, e: Entry) -> bool:
        """Pin `e` in a device slot for a restore (bringing it back from the host if needed).
        False when no device slot can be freed (every one pinned)."""
        e.priority = self.clock + e.value
        if e.slot >= 0:
            self.device.move_to_end(e.key)
            e.pins += 1
            return True
        del self.host[e.key]  # first: the slot's old entry may need room on the host
        slot = self._take_slot()
        if slot < 0:
            self.host[e.key] = e
            return False
        e.slot = slot
        self.device[e.key] = e
        self.moves_in.append((slot, e))
        self.num_onloaded += 1
        e.pins += 1
        return True

    def revalue(self, e: Entry, value: float) -> None:
        """A hit's new value (GreedyDual resets the priority to the clock plus it)."""
        e.value = value
        e.priority = self.clock + value

    def release(self, e: Entry) -> None:
        e.pins -= 1
        if e.pins < 0:
            raise RuntimeError(f"CheckpointStore.release: entry {e.key} released twice")

    def hand_to_launch(self, e: Entry) -> None:
        """The pin of a restore moves to the step being built (released once it is launched)."""
        self.launch_pins.append(e)

    def after_launch(self) -> None:
        for e in self.writing:
            e.written = True
        self.writing = []
        for e in self.launch_pins:
            self.release(e)
        self.launch_pins = []

    # -- new checkpoints -----------------------------------------------------------------------
    def reserve(self, key: int, confirm: bytes, position: int, deps, value: float = 0.0) -> int:
        """A device slot for the checkpoint the next step takes, or -1 (already stored, or no
        slot can be freed). The entry is pinned until that step is launched."""
        if self.contains(key):
            return -1
        slot = self._take_slot()
        if slot < 0:
            return -1
        e = Entry(key, confirm, position, tuple(deps), slot=slot, pins=1, value=value,
                  priority=self.clock + value, written=False)
        self.device[key] = e
        for h in e.deps:
            self.deps[h].add(key)
        self.launch_pins.append(e)
        self.writing.append(e)
        self.num_stored += 1
        return slot

    def _take_slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        victim = None
        for e in self.device.values():  # LRU order: the first of the lowest priority
            if e.pins == 0 and (victim is None or e.priority < victim.priority):
                victim = e
        if victim is None:
            return -1
        self.clock = max(self.clock, victim.priority)
        slot = victim.slot
        del self.device[victim.key]
        victim.slot = -1
        if self.host_slots > 0:
            while len(self.host) >= self.host_slots:
                self._forget(self.host.popitem(last=False)[1])
            self.host[victim.key] = victim
            self.moves_out.append((slot, victim))
            self.num_offloaded += 1
        else:
            self._forget(victim)
        return slot

    # -- consistency with the block manager ----------------------------------------------------
    def drop_dependent(self, block_hash: int) -> None:
        """A cached attention block left the device pool for good: drop the checkpoints above it."""
        keys = self.deps.pop(block_hash, None)
        for key in keys or ():
            e = self.device.get(key) or self.host.get(key)
            if e is not None and not e.pins:
                self._drop(e)

    def _drop(self, e: Entry) -> None:
        if e.slot >= 0:
            del self.device[e.key]
            self.free_slots.append(e.slot)
            e.slot = -1
        else:
            del self.host[e.key]
        self._forget(e)

    # -- after a fault (serving/recovery.py) ---------------------------------------------------
    def abandon_launch(self) -> None:
        """The step being built was never launched: the entries it would have written go (a
        later step would otherwise mark them written), and its restore pins are released."""
        writing = {id(e) for e in self.writing}
        for e in self.launch_pins:
            if id(e) not in writing:
                self.release(e)
        for e in self.writing:
            e.pins = 0
            self._drop(e)
        self.writing, self.launch_pins = [], []

    def clear(self) -> None:
        """A device step failed: what it wrote into the pool is unknown, so every entry goes
        (the pages are forgotten likewise). Moves not carried out yet go with them."""
        self.abandon_launch()
        for e in list(self.device.values()) + list(self.host.values()):
            e.pins = 0
            self._drop(e)
        self.moves_out, self.moves_in = [], []

    def _forget(self, e: Entry) -> None:
        self.num_evicted += 1
        e.host = None
        for h in e.deps:
            s = self.deps.get(h)
            if s is not None:
                s.discard(e.key)
                if not s:
                    del self.deps[h]

    # -- engine side ---------------------------------------------------------------------------
    def take_moves(self):
        """(out, in) moves recorded since the last call: lists of (device slot, entry)."""
        out, self.moves_out = self.moves_out, []
        inn, self.moves_in = self.moves_in, []
        return out, inn

    def stats(self) -> dict:
        return {
            "checkpoints_stored": self.num_stored,
            "checkpoints_evicted": self.num_evicted,
            "checkpoints_offloaded": self.num_offloaded,
            "checkpoints_onloaded": self.num_onloaded,
            "checkpoint_bytes": self.nbytes,
            "checkpoint_device_slots": self.device_slots,
            "checkpoint_host_slots": self.host_slots,
            "checkpoints_device": len(self.device),
            "checkpoints_host": len(self.host),
            "checkpoint_device_bytes": len(self.device) * self.nbytes,
            "checkpoint_host_bytes": len(self.host) * self.nbytes,
        }
