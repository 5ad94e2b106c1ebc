"""Reading one checkpoint tensor with a shape check (shared by the family converters)."""

from __future__ import annotations

import numpy as np


def take(get_tensor, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """get_tensor(name) with its shape checked; ValueError names the tensor, expected and got."""
    tensor = get_tensor(name)
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(shape)} from config.json")
    return tensor
