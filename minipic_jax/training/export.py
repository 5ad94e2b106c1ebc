"""Export trained params as an HF folder: config.json + model.safetensors (HF tensor names) +
the source model's tokenizer files. `LLM(model=folder)` and transformers both load it."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

# chat_template.jinja: where transformers 5 saves a chat template (not in tokenizer_config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json", "chat_template.jinja")


def export_hf(params: dict, cfg, family, out_dir, *, source_folder=None,
              dtype: str = "float32") -> pathlib.Path:
    """Write the folder; returns its path. A source folder's config.json is kept (extra keys
    survive), else one is written from `cfg`. Presets without tokenizer files load with the
    tokenizer the loader derives from the config (bytes or Llama 3)."""
    from safetensors.numpy import save_file
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"export dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    np_dtype = np.float32
    if dtype == "bfloat16":
        import ml_dtypes
        np_dtype = ml_dtypes.bfloat16
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = family.to_hf(params, cfg, np_dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    src = pathlib.Path(source_folder) if source_folder is not None else None
    if src is not None and (src / "config.json").exists():
        hf = json.loads((src / "config.json").read_text())
    else:
        hf = family.to_hf_config(cfg)
    hf.pop("torch_dtype", None)
    hf["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if src is not None:
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)
    return out
