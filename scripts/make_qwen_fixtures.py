"""Build tiny random HF Qwen3.5 text models and record transformers' outputs as test oracles.

Run with the torch reference env (transformers 5.24.0, torch path: no fla, no causal-conv1d):

    python scripts/make_qwen_fixtures.py
    python scripts/make_qwen_fixtures.py --float64-truth   # only add reference_f64.npz (below)

Each case writes `tests/fixtures/<name>/` (config.json + safetensors via `save_pretrained`) and
`reference.npz` with, per prompt i:
  prompt_i  [Lp]        int32 prompt token ids
  greedy_i  [G]         int32 tokens of `generate(do_sample=False)` (HF's cached decode path)
  logits_i  [Lp+G-1, V] float32 logits of one uncached forward over prompt + greedy[:-1]
  conv_i    [Lg, C, Kc] float32 conv states of every GDN layer after prefilling the prompt
  delta_i   [Lg, Hv, Dk, Dv] float32 recurrent states after prefilling the prompt

`--float64-truth` rebuilds nothing: it loads each saved case, runs the same uncached forward over
the same tokens in float64 and writes `reference_f64.npz` with logits_i [Lp+G-1, V] (float64
results rounded once to float32: <= 2.4e-7 off, far below float32's own forward error). Every op
runs in float64 (Float64Everywhere rewrites HF's hard-coded float32 casts and rejects any
lower-precision result), and the float64 truth is checked against a token-by-token decode in
float64 (HF's sequential gated-delta recurrence, not the chunked UT form).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import numpy as np
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
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


class Float64Everywhere(TorchDispatchMode):
    """Every aten op in float64: a float32 dtype argument (HF's RMSNorm, gated norm, GDN and
    softmax casts, rotary tables) becomes float64, and any lower-precision result is an error."""

    LOW = (torch.float32, torch.float16, torch.bfloat16)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        up = lambda v: torch.float64 if v is torch.float32 else v  # noqa: E731
        out = func(*map(up, args), **{k: up(v) for k, v in (kwargs or {}).items()})
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype in self.LOW:
                raise TypeError(f"{func} returned {t.dtype} under Float64Everywhere")
        return out


def float64_model(case_dir: pathlib.Path):
    """The saved case in float64, its rotary inv_freq recomputed in float64 (the buffer was
    built in float32 at init)."""
    model = Qwen3_5ForCausalLM.from_pretrained(case_dir).double().eval()
    rot = model.model.rotary_emb
    with Float64Everywhere():
        inv_freq, _ = rot.compute_default_rope_parameters(model.config)
    rot.inv_freq, rot.original_inv_freq = inv_freq, inv_freq.clone()
    return model


def float64_truth(case_dir: pathlib.Path):
    """reference_f64.npz for a saved case: float64 logits over prompt + greedy[:-1] of
    reference.npz. Returns per prompt (HF float32 - truth, chunked - stepwise float64) max abs."""
    assert json.loads((case_dir / "config.json").read_text())["rope_parameters"]["rope_type"] \
        == "default", "float64_model recomputes default RoPE only"
    ref = np.load(case_dir / "reference.npz")
    model, arrays, report = float64_model(case_dir), {}, []
    for i in range(sum(k.startswith("prompt_") for k in ref.files)):
        ids = torch.tensor(np.concatenate([ref[f"prompt_{i}"], ref[f"greedy_{i}"][:-1]])[None]
                           .astype(np.int64))
        with torch.no_grad(), Float64Everywhere():
            truth = model(input_ids=ids).logits[0].numpy()
            cache, steps = None, []
            for t in range(ids.shape[1]):
                out = model(input_ids=ids[:, t:t + 1], use_cache=True, cache=cache)
                cache = out.cache
                steps.append(out.logits[0, -1].numpy())
        assert truth.dtype == np.float64
        report.append((np.abs(ref[f"logits_{i}"] - truth).max(),
                       np.abs(np.stack(steps) - truth).max()))
        arrays[f"logits_{i}"] = truth.astype(np.float32)
    np.savez_compressed(case_dir / "reference_f64.npz", **arrays)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1]
                                         / "tests" / "fixtures"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--float64-truth", action="store_true",
                    help="only write reference_f64.npz next to each saved case")
    args = ap.parse_args()
    assert transformers.__version__ == "5.24.0", transformers.__version__
    torch.set_num_threads(1)
    if args.float64_truth:
        for name in CASES:
            for i, (hf32, steps) in enumerate(float64_truth(pathlib.Path(args.out) / name)):
                print(f"{name} prompt {i}: |HF float32 - f64| {hf32:.3e}, "
                      f"|f64 chunked - f64 stepwise| {steps:.1e}")
        return
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
