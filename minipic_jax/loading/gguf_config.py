"""A Llama GGUF's metadata -> ModelConfig, and its tensors under the HF names the family reads.

llama.cpp's converter stores q_proj/k_proj with each head's rows reordered for its RoPE, which
rotates adjacent pairs (x[2i], x[2i+1]); HF Llama (and this engine) rotate halves (x[i],
x[i + D/2]). Within a head of D rows the converter put HF row s*D/2 + i at row 2i + s;
`unpermute_rope_rows` puts them back, so the GGUF loads into the same params an HF folder gives.
"""

from __future__ import annotations

import numpy as np

from configs.model_config import ModelConfig, RopeConfig
from minipic_jax.loading.gguf_reader import GGUFError, GGUFFile

SUPPORTED_ARCHITECTURES = ("llama",)

# llama.cpp tensor name -> HF name, per layer ("blk.{i}." -> "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def check_architecture(gguf: GGUFFile) -> str:
    """general.architecture, or GGUFError naming the architecture when it is not supported."""
    arch = gguf.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{gguf.path}: GGUF architecture {arch!r} is not supported "
                        f"(general.architecture must be one of {SUPPORTED_ARCHITECTURES})")
    return arch


def _meta(gguf: GGUFFile, key: str, default=None):
    value = gguf.metadata.get(key, default)
    if value is None:
        raise GGUFError(f"{gguf.path}: GGUF metadata has no {key!r}, needed for the model config")
    return value


def _rope(gguf: GGUFFile, arch: str, head_dim: int) -> RopeConfig:
    dims = int(gguf.metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if dims != head_dim:
        raise GGUFError(f"{gguf.path}: {arch}.rope.dimension_count={dims} != head_dim {head_dim}; "
                        f"partial rotary embeddings are not supported")
    if "rope_freqs.weight" in gguf:
        raise GGUFError(f"{gguf.path}: tensor 'rope_freqs.weight' (Llama 3.1-style scaled RoPE "
                        f"frequencies) is not supported from GGUF; load the HF folder instead")
    theta = float(gguf.metadata.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = gguf.metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return RopeConfig(theta=theta)
    if scaling == "linear":
        factor = float(_meta(gguf, f"{arch}.rope.scaling.factor"))
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    raise GGUFError(f"{gguf.path}: {arch}.rope.scaling.type={scaling!r} is not supported "
                    f"(none or linear)")


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """The ModelConfig of a Llama GGUF, from its `llama.*` and `tokenizer.ggml.*` metadata.

    Tied embeddings when the file has no output.weight (as llama.cpp does); the vocabulary size
    from llama.vocab_size, else the token list, else the embedding rows. Raises GGUFError naming
    the key for missing or unsupported settings."""
    arch = check_architecture(gguf)
    m = gguf.metadata
    hidden = int(_meta(gguf, f"{arch}.embedding_length"))
    heads = int(_meta(gguf, f"{arch}.attention.head_count"))
    kv_heads = int(m.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(m.get(f"{arch}.attention.key_length", hidden // heads))
    if int(m.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{gguf.path}: {arch}.attention.value_length != key_length is not "
                        f"supported")
    vocab = m.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = m.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else gguf.tensors["token_embd.weight"].shape[0]
    eos = m.get("tokenizer.ggml.eos_token_id")
    bos = m.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        model_type="llama", vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(_meta(gguf, f"{arch}.feed_forward_length")),
        num_layers=int(_meta(gguf, f"{arch}.block_count")), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(m.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope=_rope(gguf, arch, head_dim),
        tie_word_embeddings="output.weight" not in gguf,
        max_position_embeddings=int(_meta(gguf, f"{arch}.context_length")),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),))


def hf_to_gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, for every tensor the Llama family reads."""
    names = {hf: gg for gg, hf in _GLOBAL_NAMES.items()}
    if cfg.tie_word_embeddings:
        del names["lm_head.weight"]
    for i in range(cfg.num_layers):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for gg, hf in _LAYER_NAMES.items()})
    return names


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (pair i, member s) -> (half s, index i)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order from HF's (the inverse of unpermute_rope_rows; for writing
    test GGUFs)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _listed(names: list[str]) -> str:
    return f"{names[:5]}" + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


def check_tensors(gguf: GGUFFile, cfg: ModelConfig) -> dict[str, str]:
    """hf_to_gguf_names, after checking the file holds exactly the tensors the Llama family
    reads: GGUFError lists missing ones, and ones it would ignore (biases, say), since dropping
    a weight silently would change the model."""
    names = hf_to_gguf_names(cfg)
    missing = [g for g in names.values() if g not in gguf]
    if missing:
        raise GGUFError(f"{gguf.path}: GGUF is missing tensor(s) {_listed(missing)} needed by "
                        f"the llama model")
    wanted = set(names.values())
    extra = [t for t in gguf.tensors if t not in wanted]
    if extra:
        raise GGUFError(f"{gguf.path}: GGUF has tensor(s) {_listed(extra)} that the llama model "
                        f"does not read (attention/MLP biases are not supported)")
    return names


def tensor_getter(gguf: GGUFFile, cfg: ModelConfig, names: dict[str, str]):
    """get_tensor(HF name) -> float32 numpy array in HF layout, for llama_hf.convert_hf."""

    def get(hf_name: str) -> np.ndarray:
        w = gguf.tensor(names[hf_name])
        if hf_name.endswith("q_proj.weight"):
            return unpermute_rope_rows(w, cfg.num_heads)
        if hf_name.endswith("k_proj.weight"):
            return unpermute_rope_rows(w, cfg.num_kv_heads)
        return w

    return get
