"""Attention metadata for one ragged batch: an explicit pytree, built on the host each step.

Tokens are flat over the batch ([T]); sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1].
Pad tokens never appear as queries: a page holds its valid (non-pad) tokens as a prefix of its
slots, so the logical position of slot j of block-table entry b of sequence s is
`block_pos_start[s, b] + j`, valid while `j < block_num_valid[s, b]`. Rows past the real tokens of a
bucket-padded batch belong to no sequence (their outputs are garbage, their slot_mapping is -1).
"""

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    q_positions: jax.Array  # [T] int32 logical position of each query token
    q_window_start: jax.Array  # [T] int32 smallest key logical position the query may attend
    q_seq: jax.Array  # [T] int32 sequence index of each query token (0 for padding rows)
    cu_q_lens: jax.Array  # [S+1] int32 query row offsets per sequence
    num_blocks: jax.Array  # [S] int32 block-table entries in use per sequence
    block_tables: jax.Array  # [S, NB] int32 physical page of each logical block
    block_pos_start: jax.Array  # [S, NB] int32 logical position of the block's first slot
    block_num_valid: jax.Array  # [S, NB] int32 valid slots (a prefix) of each block; 0 if unused
    slot_mapping: jax.Array  # [T] int32 flat slot (page * B + offset) to write new K/V; -1 = none

    @property
    def num_tokens(self) -> int:
        return self.q_positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]
