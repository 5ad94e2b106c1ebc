"""`load_model`: an HF folder, a GGUF or a preset -> config, params, family module, tokenizer."""

from __future__ import annotations

import dataclasses
import pathlib
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from configs.model_config import ModelConfig
from configs.presets import get_preset, is_preset, preset_names
from minipic_jax.loading import param_cache
from minipic_jax.loading.gguf_load import gguf_in, load_gguf
from minipic_jax.loading.hf_config import model_config_from_folder
from minipic_jax.loading.safetensors_io import SafetensorsReader, weight_files
from minipic_jax.loading.tokenizer import Tokenizer, load_tokenizer
from minipic_jax.models import get_family

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Without an explicit cache_dir, only checkpoints at least this large are cached (a tiny model
# converts faster than orbax writes it).
AUTO_CACHE_MIN_BYTES = 256 << 20


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: Any  # the family's params pytree
    family: ModuleType  # implements serving.model_contract.ModelFamily
    tokenizer: Tokenizer | None
    source: str  # "folder:<abs path>", "gguf:<abs path>" or "preset:<name>"
    from_cache: bool = False  # params came from the orbax cache (conversion skipped)
    # the checkpoint files the params were converted from (() for a preset): the span store
    # fingerprints the weights by their bytes (serving/tiers/fingerprint.py)
    weight_files: tuple = ()


def _dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return jnp.dtype(dtype).type


def load_model(model: str | pathlib.Path, *, dtype="float32", seed: int = 0,
               cache_dir: str | pathlib.Path | None | bool = None,
               host: bool = False) -> LoadedModel:
    """Load an HF checkpoint folder or a GGUF, or instantiate a preset (deterministic random
    weights).

    Args:
      model: a folder with config.json + *.safetensors (single or sharded with an index), a
        Llama GGUF file (or a folder holding one .gguf and no safetensors; gguf_load.py), an
        "org/name" repo id already in the local HF hub cache (no download), or a preset name
        from configs/presets.py (e.g. "tiny-llama3", "llama3_1_8b").
      dtype: "float32" or "bfloat16" (params and compute dtype).
      seed: PRNG seed for preset weights.
      cache_dir: orbax cache of converted params. None: the default cache
        ($MINIPIC_JAX_CACHE_DIR or ~/.cache/minipic_jax/params), used for checkpoints of at least
        256 MiB; a path: always cache there; False: never cache.
      host: for a checkpoint folder, params are numpy views of the memory-mapped tensors in the
        family's layout (checkpoint dtype, nothing read or copied yet, no orbax cache), which
        tensor parallelism streams tensor by tensor to the devices (serving/step/sharding.py,
        stream_params). Presets are unaffected.
    Raises:
      ValueError naming the problem: unknown preset or missing folder (lists presets), folder
      without weights, unsupported model_type/architecture, missing or mis-shaped tensor; for a
      GGUF (gguf_reader.GGUFError): truncated file, unsupported tensor type or architecture.
    """
    jdtype = _dtype(dtype)
    path = pathlib.Path(model).expanduser()
    gguf_file = gguf_in(path)
    if gguf_file is not None:
        cfg, params, family, tok, source, cached = load_gguf(gguf_file, jdtype, cache_dir, host,
                                                             AUTO_CACHE_MIN_BYTES)
        return LoadedModel(cfg, params, family, tok, source, from_cache=cached)
    if path.is_dir():
        return _load_folder(path, jdtype, cache_dir, host)
    cached = _hf_cache_snapshot(str(model))
    if cached is not None:
        return _load_folder(cached, jdtype, cache_dir, host)
    if isinstance(model, str) and is_preset(model):
        cfg = get_preset(model)
        family = get_family(cfg.model_type)
        params = family.init_params(cfg, jax.random.key(seed), jdtype)
        return LoadedModel(cfg, params, family, load_tokenizer(None, cfg), f"preset:{model}")
    raise ValueError(f"model {str(model)!r} is not an existing folder, a repo id in the local "
                     f"HF cache, or a known preset; presets: {', '.join(preset_names())}")


def _hf_cache_snapshot(model: str) -> pathlib.Path | None:
    """An "org/name" repo id already in the local HF hub cache (never downloads)."""
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download
        return pathlib.Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not cached, or not a valid repo id
        return None


def _load_folder(folder: pathlib.Path, dtype, cache_dir, host: bool = False) -> LoadedModel:
    folder = folder.resolve()
    _, family, cfg = model_config_from_folder(folder)
    files = weight_files(folder)
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {others}; only safetensors are supported)" if others else ""
        raise ValueError(f"{folder} has no *.safetensors weights{hint}")
    tokenizer = load_tokenizer(folder, cfg)
    source = f"folder:{folder}"

    use_cache = not host and cache_dir is not False and (
        cache_dir is not None or sum(f.stat().st_size for f in files) >= AUTO_CACHE_MIN_BYTES)
    entry = None
    if use_cache:
        root = pathlib.Path(cache_dir) if cache_dir is not None else param_cache.default_cache_dir()
        key = param_cache.cache_key(folder, files + [folder / "config.json"], dtype,
                                    family.__name__)
        entry = root / key
        abstract = jax.eval_shape(lambda: family.init_params(cfg, jax.random.key(0), dtype))
        params = param_cache.restore(entry, abstract)
        if params is not None:
            return LoadedModel(cfg, params, family, tokenizer, source, from_cache=True,
                               weight_files=tuple(files))

    reader = SafetensorsReader(files)
    needed = family.hf_tensor_names(cfg)
    missing = [n for n in needed if n not in reader]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{folder}: checkpoint is missing tensor(s) {missing[:5]}{more} "
                         f"needed by the {cfg.model_type} model")
    if host:
        return LoadedModel(cfg, family.convert_hf(reader.get, cfg, dtype, host=True), family,
                           tokenizer, source, weight_files=tuple(files))
    params = family.convert_hf(reader.get, cfg, dtype)
    if entry is not None:
        param_cache.save(entry, params)
    return LoadedModel(cfg, params, family, tokenizer, source, weight_files=tuple(files))
