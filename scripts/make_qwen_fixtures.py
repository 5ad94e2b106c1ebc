"""Build tiny random HF Qwen3.5 text models and record transformers' outputs as test oracles.

Run with the torch reference env (transformers 5.24.0, torch path: no fla, no causal-conv1d):

    python scripts/make_qwen_fixtures.py

Each case writes `tests/fixtures/<name>/` (config.json + safetensors via `save_pretrained`) and
`reference.npz` with, per prompt i:
  prompt_i  [Lp]        int32 prompt token ids
  greedy_i  [G]         int32 tokens of `generate(do_sample=False)` (HF's cached decode path)
  logits_i  [Lp+G-1, V] float32 logits of one uncached forward over prompt + greedy[:-1]
  conv_i    [Lg, C, Kc] float32 conv states of every GDN layer after prefilling the prompt
  delta_i   [Lg, Hv, Dk, Dv] float32 recurrent states after prefilling the prompt
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

import numpy as np
import torch
import transformers
from make_hf_fixtures import greedy_and_logits  # scripts/ is on sys.path when run as a script
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

BOS, EOS, VOCAB = 256, 257, 260  # byte-level ids, like the Llama fixtures
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, max_position_embeddings=4096,
            initializer_range=0.2)
CASES = {
    # GVA 2 (4 value heads over 2 key heads), Dk != Dv, partial rotary 25% (R = 4).
    "qwen3_5_gva2": dict(BASE, num_hidden_layers=4, tie_word_embeddings=False,
                         layer_types=["linear_attention", "linear_attention", "full_attention",
                                      "linear_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.25}),
    # Attention first, equal heads, tied embeddings, partial rotary 50%.
    "qwen3_5_tied": dict(BASE, num_hidden_layers=3, tie_word_embeddings=True, num_key_value_heads=1,
                         layer_types=["full_attention", "linear_attention", "linear_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                         linear_value_head_dim=8,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.5}),
}
PROMPT_LENS = (5, 70, 150)  # below, across one, and across two chunk boundaries (chunk 64)
MAX_NEW = 6


def build_model(kwargs: dict, seed: int):
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kwargs))
    # HF zero-initialises the (1 + w) norms and sets the gated norm to 1 and dt_bias to 1:
    # random values make the tests see every weight.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model.float().eval()


def gdn_states(model, prompt):
    ids = torch.tensor(prompt[None].astype(np.int64))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    conv, delta = [], []
    for i, kind in enumerate(model.config.layer_types):
        if kind == "linear_attention":
            layer = cache.layers[i]
            conv.append(layer.conv_states[0][0].float().numpy())
            delta.append(layer.recurrent_states[0][0].float().numpy())
    return np.stack(conv), np.stack(delta)


def record(model, out_dir: pathlib.Path, seed: int):
    rng = np.random.default_rng(seed)
    arrays = {}
    for i, length in enumerate(PROMPT_LENS):
        prompt = rng.integers(0, 256, size=length).astype(np.int64)
        greedy, logits = greedy_and_logits(model, prompt, MAX_NEW)
        conv, delta = gdn_states(model, prompt)
        arrays.update({f"prompt_{i}": prompt.astype(np.int32), f"greedy_{i}": greedy.astype(np.int32),
                       f"logits_{i}": logits.astype(np.float32), f"conv_{i}": conv,
                       f"delta_{i}": delta})
    np.savez_compressed(out_dir / "reference.npz", **arrays)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1]
                                         / "tests" / "fixtures"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    assert transformers.__version__ == "5.24.0", transformers.__version__
    torch.set_num_threads(1)
    for i, (name, kwargs) in enumerate(CASES.items()):
        out_dir = pathlib.Path(args.out) / name
        if out_dir.exists():
            shutil.rmtree(out_dir)
        model = build_model(kwargs, args.seed + i)
        impl = model.model.layers[0].__class__.__module__
        model.save_pretrained(out_dir)
        (out_dir / "generation_config.json").unlink(missing_ok=True)
        record(model, out_dir, args.seed + i)
        print("wrote", out_dir, "(", impl, ")")


if __name__ == "__main__":
    main()
