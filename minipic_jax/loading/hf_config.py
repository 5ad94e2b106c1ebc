"""Reading an HF model folder's config.json into a family module + ModelConfig."""

from __future__ import annotations

import json
import pathlib
from types import ModuleType

from configs.model_config import ModelConfig
from minipic_jax.models import family_for_config


def read_hf_config(folder: pathlib.Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise ValueError(f"{folder} has no config.json (not an HF model folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from err


def model_config_from_folder(folder: pathlib.Path) -> tuple[dict, ModuleType, ModelConfig]:
    """(config.json dict, family module, ModelConfig); ValueError for unsupported models."""
    hf = read_hf_config(folder)
    family = family_for_config(hf)
    return hf, family, family.config_from_hf(hf)
