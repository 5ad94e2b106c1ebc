"""Deterministic batches: laid-out examples -> dense [B, L] arrays, in a seeded order.

The order is a function of (seed, epoch) only and a batch is a function of how many examples came
before it, so a resumed run that knows its data position sees exactly the batches it would have.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from minipic_jax.training.data import Example


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # [B, L] int32
    positions: np.ndarray  # [B, L] int32
    windows: np.ndarray  # [B, L] int32
    valid: np.ndarray  # [B, L] bool
    targets: np.ndarray  # [B, L] int32
    loss_mask: np.ndarray  # [B, L] bool


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def uses_plain(seed: int, index: int, plain_fraction: float) -> bool:
    """Whether global example `index` is laid out as a plain full-attention prompt."""
    return plain_fraction > 0 and np.random.default_rng([seed, 1 << 20, index]).random() < plain_fraction


def make_batch(examples: list[Example], seq_len: int) -> Batch:
    """Right-pad examples to seq_len (batch pads are invisible and carry no loss)."""
    b = len(examples)
    out = dict(tokens=np.zeros((b, seq_len), np.int32), positions=np.zeros((b, seq_len), np.int32),
               windows=np.zeros((b, seq_len), np.int32), valid=np.zeros((b, seq_len), bool),
               targets=np.zeros((b, seq_len), np.int32), loss_mask=np.zeros((b, seq_len), bool))
    for i, ex in enumerate(examples):
        n = len(ex.tokens)
        for name in out:
            out[name][i, :n] = getattr(ex, name)
    return Batch(**out)


class BatchStream:
    """Batches of `batch_size` examples from position `start` (examples consumed so far).

    get_example(record_index, plain) -> Example, cached by the caller if it likes."""

    def __init__(self, num_records: int, get_example, *, batch_size: int, seq_len: int,
                 seed: int, plain_fraction: float = 0.0, start: int = 0):
        self.n, self.get_example = num_records, get_example
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.plain_fraction = plain_fraction
        self.position = start
        self._orders: dict[int, np.ndarray] = {}

    def _record(self, index: int) -> int:
        epoch, k = divmod(index, self.n)
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.n, self.seed, epoch)}
        return int(self._orders[epoch][k])

    def next(self) -> Batch:
        idx = range(self.position, self.position + self.batch_size)
        examples = [self.get_example(self._record(i),
                                     uses_plain(self.seed, i, self.plain_fraction)) for i in idx]
        self.position += self.batch_size
        return make_batch(examples, self.seq_len)
