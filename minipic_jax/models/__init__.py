"""Model family registry: HF `model_type` -> the family module (it implements
serving.model_contract.ModelFamily).

Family modules are imported lazily, so a family that is missing or broken does not stop others.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES: dict[str, str] = {
    "llama": "minipic_jax.models.llama",
    "mistral": "minipic_jax.models.llama",
    "qwen3_5": "minipic_jax.models.qwen3_5",
    "qwen3_5_text": "minipic_jax.models.qwen3_5",
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def get_family(model_type: str | None) -> ModuleType:
    """The family module for an HF model_type; ValueError naming it and the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(FAMILIES)}")
    name = FAMILIES[model_type]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        raise ValueError(f"model_type {model_type!r} maps to {name}, which is not available "
                         f"in this build") from err


def family_for_config(hf_config: dict) -> ModuleType:
    """The family for a config.json dict (by model_type, else by its architectures)."""
    model_type = hf_config.get("model_type")
    if model_type is None:
        archs = hf_config.get("architectures") or []
        guess = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen3_5ForCausalLM": "qwen3_5_text",
                 "Qwen3_5ForConditionalGeneration": "qwen3_5"}
        model_type = next((guess[a] for a in archs if a in guess), None)
        if model_type is None:
            raise ValueError(f"config.json has no model_type and unsupported architectures "
                             f"{archs}; supported model types: {', '.join(FAMILIES)}")
    return get_family(model_type)
