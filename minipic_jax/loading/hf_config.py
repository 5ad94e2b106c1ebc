"""Reading an HF model folder's config.json into a family module + ModelConfig."""

from __future__ import annotations

import dataclasses
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


def generation_eos_ids(folder: pathlib.Path) -> tuple[int, ...]:
    """EOS ids listed in the folder's generation_config.json (an int or a list), else ()."""
    path = folder / "generation_config.json"
    if not path.exists():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from err
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def model_config_from_folder(folder: pathlib.Path) -> tuple[dict, ModuleType, ModelConfig]:
    """(config.json dict, family module, ModelConfig); ValueError for unsupported models.

    EOS ids listed in generation_config.json (as vLLM reads them) join config.json's."""
    hf = read_hf_config(folder)
    family = family_for_config(hf)
    cfg = family.config_from_hf(hf)
    extra = [e for e in generation_eos_ids(folder) if e not in cfg.eos_token_ids]
    if extra:
        cfg = dataclasses.replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(extra))
    return hf, family, cfg
