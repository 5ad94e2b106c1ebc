"""Orbax checkpoints of a training run: trainable params, optimizer state and data position.

A checkpoint holds everything that changes during training; the rest (base weights, data,
config) comes from the run's arguments, which are stored alongside and checked on resume, so a
killed run restarted with the same arguments continues exactly where the last checkpoint was.
"""

from __future__ import annotations

import pathlib

import jax


def _manager(directory: pathlib.Path, max_to_keep: int = 2):
    import orbax.checkpoint as ocp
    return ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True))


def save(directory: pathlib.Path, step: int, state, meta: dict) -> None:
    """Write checkpoint `step` (state pytree + JSON meta) and wait for it to land."""
    import orbax.checkpoint as ocp
    with _manager(directory) as mngr:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()


def latest(directory: pathlib.Path, abstract_state):
    """(step, state, meta) of the newest checkpoint, or None when there is none."""
    import orbax.checkpoint as ocp
    if not directory.exists():
        return None
    with _manager(directory) as mngr:
        step = mngr.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract_state)
        got = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return step, got["state"], dict(got["meta"])
