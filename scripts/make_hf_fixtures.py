"""Build tiny random HF Llama-family models and record transformers' outputs as test oracles.

Run with the torch reference env (transformers 5.24.0):

    python scripts/make_hf_fixtures.py            # all fixtures
    python scripts/make_hf_fixtures.py --live DIR --seed 7   # one fresh case

Each case writes `<out>/<name>/` (config.json + safetensors via `save_pretrained`) and
`<out>/<name>/reference.npz` with, per prompt i:
  prompt_i  [Lp]       int32 prompt token ids
  greedy_i  [G]        int32 tokens of `generate(do_sample=False)` (stops early on eos)
  logits_i  [Lp+G-1, V] float32 logits of one full forward over prompt + greedy[:-1]
and `inv_freq` [R/2] (the model's rotary buffer). `rope_cases.npz` holds HF's own RoPE application
(apply_rotary_pos_emb) for default / llama3 / linear and partial-rotary configs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

BOS, EOS, VOCAB = 256, 257, 260  # byte-level ids 0..255, matching minipic_jax's ByteTokenizer
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=BOS, eos_token_id=EOS,
            max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
            initializer_range=0.2)

CASES = {
    # GQA ratio 1 (MHA), default RoPE.
    "llama_mha": dict(BASE, num_key_value_heads=4, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": 10000.0}),
    # GQA ratio 2, Llama 3.1 scaling with a small original context so all three bands occur.
    "llama_gqa2_llama3rope": dict(BASE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # GQA ratio 4, head_dim != hidden / heads, tied embeddings, linear scaling; saved sharded.
    "llama_gqa4_tied_hd16": dict(BASE, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                 tie_word_embeddings=True, rope_parameters={
                                     "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    # Mistral (no sliding window), GQA ratio 4.
    "mistral_gqa4": dict(BASE, num_key_value_heads=1, sliding_window=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
SHARDED = {"llama_gqa4_tied_hd16": "30KB"}
PROMPT_LENS = (3, 7, 12)
MAX_NEW = 6


def build_model(name: str, kwargs: dict, seed: int):
    torch.manual_seed(seed)
    if name.startswith("mistral"):
        model = MistralForCausalLM(MistralConfig(**kwargs))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    # HF initialises norms to 1; random norm weights make the test see them.
    with torch.no_grad():
        for mod_name, p in model.named_parameters():
            if mod_name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.float().eval()


def greedy_and_logits(model, prompt, max_new: int):
    """HF's oracle for one prompt [Lp] int64: the tokens of `generate(do_sample=False)` (its
    cached decode path) [G] and the float32 logits of one uncached forward over prompt +
    greedy[:-1], [Lp + G - 1, V]. Shared with make_qwen_fixtures.py."""
    ids = torch.tensor(prompt[None])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             do_sample=False, max_new_tokens=max_new, pad_token_id=EOS)
        greedy = out[0, len(prompt):].numpy()
        full = torch.tensor(np.concatenate([prompt, greedy[:-1]])[None])
        logits = model(input_ids=full).logits[0].float().numpy()
    return greedy, logits


def record(model, out_dir: pathlib.Path, seed: int, prompt_lens=PROMPT_LENS, max_new=MAX_NEW):
    rng = np.random.default_rng(seed)
    arrays = {"inv_freq": model.model.rotary_emb.inv_freq.numpy().astype(np.float32)}
    for i, length in enumerate(prompt_lens):
        prompt = rng.integers(0, 256, size=length).astype(np.int64)
        greedy, logits = greedy_and_logits(model, prompt, max_new)
        arrays[f"prompt_{i}"] = prompt.astype(np.int32)
        arrays[f"greedy_{i}"] = greedy.astype(np.int32)
        arrays[f"logits_{i}"] = logits.astype(np.float32)
    np.savez_compressed(out_dir / "reference.npz", **arrays)


def make_case(name: str, kwargs: dict, out_root: pathlib.Path, seed: int, shard=None):
    out_dir = out_root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model = build_model(name, kwargs, seed)
    save_kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out_dir, **save_kw)
    record(model, out_dir, seed)
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    return out_dir


def rope_cases(out_root: pathlib.Path, seed: int):
    """HF's RoPE (inv_freq + apply_rotary_pos_emb) on random q/k at scattered positions."""
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.qwen3_5 import configuration_qwen3_5 as qc
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
    g = torch.Generator().manual_seed(seed)
    positions = torch.tensor([[0, 1, 5, 63, 64, 100, 1000, 8191, 8192, 20000, 131071]])
    cases = {
        "default": ml.LlamaRotaryEmbedding(LlamaConfig(**dict(BASE, head_dim=32, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0}))),
        "llama3": ml.LlamaRotaryEmbedding(LlamaConfig(**dict(
            BASE, head_dim=64, max_position_embeddings=131072, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))),
        "linear": ml.LlamaRotaryEmbedding(LlamaConfig(**dict(BASE, head_dim=16, rope_parameters={
            "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}))),
        "partial_default": mq.Qwen3_5TextRotaryEmbedding(qc.Qwen3_5TextConfig(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25})),
    }
    arrays = {"positions": positions[0].numpy().astype(np.int32)}
    for name, emb in cases.items():
        cfg = emb.config
        head_dim = cfg.head_dim
        q = torch.randn(1, 3, positions.shape[1], head_dim, generator=g)
        k = torch.randn(1, 2, positions.shape[1], head_dim, generator=g)
        cos, sin = emb(q, positions)
        apply = mq.apply_rotary_pos_emb if name.startswith("partial") else ml.apply_rotary_pos_emb
        q_rot, k_rot = apply(q, k, cos, sin)
        arrays[f"{name}_config"] = np.frombuffer(json.dumps(
            {"head_dim": head_dim, **cfg.rope_parameters}).encode(), dtype=np.uint8)
        arrays[f"{name}_inv_freq"] = emb.inv_freq.numpy().astype(np.float32)
        for tag, t in (("q", q), ("k", k), ("q_rot", q_rot), ("k_rot", k_rot)):
            arrays[f"{name}_{tag}"] = t[0].transpose(0, 1).numpy().astype(np.float32)  # [T, N, D]
    np.savez_compressed(out_root / "rope_cases.npz", **arrays)


def live_case(out_dir: pathlib.Path, seed: int):
    """One fresh random config (for the live parity test): random GQA ratio, head_dim, rope."""
    rng = np.random.default_rng(seed)
    kv = int(rng.choice([1, 2, 4]))
    heads = kv * int(rng.choice([1, 2, 4]))
    rope = [{"rope_type": "default", "rope_theta": float(rng.choice([1e4, 5e5]))},
            {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
            {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}][int(rng.integers(3))]
    kwargs = dict(BASE, num_attention_heads=heads, num_key_value_heads=kv,
                  head_dim=int(rng.choice([8, 16])), tie_word_embeddings=bool(rng.integers(2)),
                  rope_parameters=rope)
    out_dir.mkdir(parents=True, exist_ok=True)
    return make_case("llama_live", kwargs, out_dir, seed)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1]
                                         / "tests" / "fixtures"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--live", default=None, help="write one fresh random case into this folder")
    args = ap.parse_args()
    assert transformers.__version__ == "5.24.0", transformers.__version__
    torch.set_num_threads(1)
    if args.live:
        print(live_case(pathlib.Path(args.live), args.seed))
        return
    out_root = pathlib.Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    for i, (name, kwargs) in enumerate(CASES.items()):
        print("wrote", make_case(name, kwargs, out_root, args.seed + i, SHARDED.get(name)))
    rope_cases(out_root, args.seed)
    print("wrote", out_root / "rope_cases.npz")


if __name__ == "__main__":
    main()
