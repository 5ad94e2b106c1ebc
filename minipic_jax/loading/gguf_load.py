"""Loading a Llama GGUF checkpoint: `LLM(model="x.gguf")`, or a folder holding one .gguf.

Order of work: parse and check the whole file (truncation, tensor types, architecture, config
keys, every needed tensor present) before any tensor is dequantized; then the params from the
orbax cache when an entry exists, else each tensor dequantized to float32 by the `gguf` package,
q/k rows put back in HF's RoPE order, and converted by the Llama family's HF converter into the
dtype asked for. The tokenizer is the `tokenizer.json` beside the file when there is one, else the
one the GGUF's metadata describes (gguf_tokenizer.py).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from minipic_jax.loading import param_cache
from minipic_jax.loading.gguf_config import check_tensors, config_from_gguf, tensor_getter
from minipic_jax.loading.gguf_reader import GGUFError, GGUFFile
from minipic_jax.loading.gguf_tokenizer import GGUFTokenizer
from minipic_jax.loading.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from minipic_jax.models import get_family

GGUF_SUFFIX = ".gguf"


def gguf_in(path: pathlib.Path) -> pathlib.Path | None:
    """The GGUF file `path` names: itself when it is a .gguf file, the one .gguf of a folder
    that has no safetensors, else None (an HF folder or something else). A folder with several
    .gguf files and no safetensors is an error listing them."""
    if path.is_file():
        return path if path.suffix == GGUF_SUFFIX else None
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        raise GGUFError(f"{path} holds {len(found)} GGUF files {[f.name for f in found]}; pass "
                        f"the one to load as model=<folder>/<file>.gguf")
    return found[0] if found else None


def _tokenizer(gguf: GGUFFile, cfg) -> Tokenizer | None:
    folder = gguf.path.parent
    if (folder / "tokenizer.json").exists():
        return HFTokenizer(folder, cfg)
    if "tokenizer.ggml.tokens" in gguf.metadata:
        return GGUFTokenizer(gguf)
    return load_tokenizer(None, cfg)


def load_gguf(path: pathlib.Path, dtype, cache_dir, host: bool, auto_cache_min_bytes: int):
    """(cfg, params, family, tokenizer, source, from_cache) for a Llama GGUF; GGUFError (a
    ValueError) naming the file and the defect, raised before any tensor is dequantized.

    cache_dir as in loader.load_model (None: cache when the file is at least
    `auto_cache_min_bytes`); host=True gives numpy params in the family's layout (float32,
    dequantized) for tensor-parallel streaming, never cached."""
    path = path.resolve()
    gguf = GGUFFile(path)
    cfg = config_from_gguf(gguf)
    family = get_family(cfg.model_type)
    names = check_tensors(gguf, cfg)
    tokenizer = _tokenizer(gguf, cfg)
    source = f"gguf:{path}"
    getter = tensor_getter(gguf, cfg, names)
    if host:
        host_params = family.convert_hf(getter, cfg, dtype, host=True)
        return cfg, host_params, family, tokenizer, source, False
    entry = None
    if cache_dir is not False and (cache_dir is not None
                                   or gguf.total_bytes() >= auto_cache_min_bytes):
        root = pathlib.Path(cache_dir) if cache_dir is not None else param_cache.default_cache_dir()
        entry = root / param_cache.cache_key(path, [path], dtype, family.__name__ + "+gguf")
        abstract = jax.eval_shape(lambda: family.init_params(cfg, jax.random.key(0), dtype))
        params = param_cache.restore(entry, abstract)
        if params is not None:
            return cfg, params, family, tokenizer, source, True
    # Dequantized tensors are float32 numpy already: lay them out and cast on the host, then one
    # transfer each (measured on CPU: 2x faster than the HF path's per-tensor device ops).
    host_params = family.convert_hf(getter, cfg, dtype, host=True)
    params = jax.tree.map(lambda a: jnp.asarray(np.ascontiguousarray(a, jnp.dtype(dtype))),
                          host_params)
    if entry is not None:
        param_cache.save(entry, params)
    return cfg, params, family, tokenizer, source, False
