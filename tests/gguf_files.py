"""Writing small GGUF files for tests, the way llama.cpp's converter lays them out (names,
metadata keys, q/k rows permuted for its RoPE), with each tensor stored in a chosen type."""

from __future__ import annotations

import pathlib

import numpy as np

from configs.model_config import ModelConfig
from minipic_jax.loading.gguf_config import hf_to_gguf_names, permute_rope_rows


def tiny_cfg(**overrides) -> ModelConfig:
    """A Llama whose every matrix row is 256 long, so each tensor type (K-quants included,
    block 256) can store it."""
    kw = dict(model_type="llama", vocab_size=260, hidden_size=256, intermediate_size=256,
              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5,
              tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=256,
              eos_token_ids=(257,))
    kw.update(overrides)
    return ModelConfig(**kw)


def random_hf_tensors(cfg: ModelConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float32 tensors under their HF names, in HF layout."""
    from minipic_jax.models import llama
    out = {}
    for name in llama.hf_tensor_names(cfg):
        e, d = cfg.hidden_size, cfg.head_dim
        shape = {"q_proj": (cfg.num_heads * d, e), "k_proj": (cfg.num_kv_heads * d, e),
                 "v_proj": (cfg.num_kv_heads * d, e), "o_proj": (e, cfg.num_heads * d),
                 "gate_proj": (cfg.intermediate_size, e), "up_proj": (cfg.intermediate_size, e),
                 "down_proj": (e, cfg.intermediate_size), "embed_tokens": (cfg.vocab_size, e),
                 "lm_head": (cfg.vocab_size, e)}
        key = next((k for k in shape if k in name), None)
        out[name] = (rng.normal(0, 0.2, shape[key]) if key else
                     1 + rng.normal(0, 0.1, (e,))).astype(np.float32)
    return out


def k_quant_bytes(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks (gguf cannot quantize to them) with finite f16 scales."""
    from gguf import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], np.float16).view(np.uint8)
    if qtype.name == "Q4_K":  # d, dmin (f16) lead the block
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: d (f16) ends it
        raw[..., -2:] = scale
    return raw.reshape(rows, cols // block * size)


def stored(w: np.ndarray, type_name: str, rng: np.random.Generator):
    """(bytes or array to write, raw_dtype) for `w` stored as `type_name`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w, None
    if type_name == "F16":
        return w.astype(np.float16), None
    if type_name in ("Q4_K", "Q6_K"):
        return k_quant_bytes(w.shape[0], w.shape[1], qtype, rng), qtype
    return quantize(w, qtype), qtype


def write_llama_gguf(path: pathlib.Path, cfg: ModelConfig, hf: dict[str, np.ndarray],
                     types: dict[str, str] | None = None, arch: str = "llama",
                     tokenizer=None, rng: np.random.Generator | None = None,
                     extra: dict[str, np.ndarray] | None = None) -> dict:
    """Write `hf` (HF names/layout) as a llama.cpp-style GGUF; types: HF name -> stored type
    (default F32). tokenizer: optional dict of tokenizer.ggml.* fields (tokens, merges,
    token_type, pre, chat_template). extra: more F32 tensors under GGUF names. Returns {HF name: the float32 tensor the file holds, back in
    HF layout} (the exact input for F32 tensors)."""
    import gguf
    from gguf.quants import dequantize
    from minipic_jax.loading.gguf_config import unpermute_rope_rows
    rng = rng or np.random.default_rng(0)
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer.get("pre", "default"))
        w.add_token_list(tokenizer["tokens"])
        w.add_token_merges(tokenizer["merges"])
        w.add_token_types(tokenizer["token_type"])
        if "chat_template" in tokenizer:
            w.add_chat_template(tokenizer["chat_template"])
    held = {}
    for hf_name, gg_name in hf_to_gguf_names(cfg).items():
        t = hf[hf_name]
        heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
        n = next((v for k, v in heads.items() if k in hf_name), None)
        if n is not None:
            t = permute_rope_rows(t, n)
        data, qtype = stored(t, types.get(hf_name, "F32"), rng)
        w.add_tensor(gg_name, data, raw_dtype=qtype)
        back = t if qtype is None and data.dtype == np.float32 else (
            dequantize(data, qtype) if qtype is not None else data.astype(np.float32))
        held[hf_name] = unpermute_rope_rows(back, n) if n is not None else back
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def set_tensor_type_id(path: pathlib.Path, tensor: str, type_id: int) -> None:
    """Overwrite one tensor's type id in the header (a type no writer would produce)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims
    data[at:at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))
