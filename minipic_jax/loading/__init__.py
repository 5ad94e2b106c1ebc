"""Loading models: HF folders (config.json + safetensors) or presets, params cache, tokenizers."""

from minipic_jax.loading.loader import LoadedModel, load_model
from minipic_jax.loading.tokenizer import (ByteTokenizer, HFTokenizer, Llama3Tokenizer, Tokenizer,
                                           load_tokenizer)

__all__ = ["LoadedModel", "load_model", "Tokenizer", "ByteTokenizer", "HFTokenizer",
           "Llama3Tokenizer", "load_tokenizer"]
