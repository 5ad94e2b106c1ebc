"""The span store's model fingerprint covers every weight byte (serving/tiers/fingerprint.py,
serving/tiers/weight_digests.py): a checkpoint with one changed weight never opens another's store.

Oracle: one element in the middle of a tensor (embedding row 110 of 260: the first and last
256 elements, all the old fingerprint sampled, are rows 0-7 and 252-259) changed by hand.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from conftest import FIXTURES
from minipic_jax.loading import load_model
from minipic_jax.loading.safetensors_io import weight_files
from serving.tiers import weight_digests
from serving.tiers.fingerprint import model_fingerprint
from serving.tiers.weight_digests import file_digests

EMBED = "model.embed_tokens.weight"  # [260, 32] in llama_mha
ARGS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32,
            block_size=16, num_kv_blocks=64)


def _checkpoint(path, change: float = 0.0):
    """A copy of the llama_mha fixture; `change` added to embedding element [110, 16]."""
    shutil.copytree(FIXTURES / "llama_mha", path)
    if change:
        f = path / "model.safetensors"
        tensors = safetensors.numpy.load_file(f)
        tensors[EMBED][110, 16] += change
        safetensors.numpy.save_file(tensors, f)
    return path


def test_one_changed_middle_weight_is_another_model(tmp_path, monkeypatch):
    from minipic_jax import LLM
    a, b = _checkpoint(tmp_path / "a"), _checkpoint(tmp_path / "b", change=1e-3)
    root = tmp_path / "store"
    LLM(str(a), kv_store_dir=str(root), **ARGS)
    with pytest.raises(ValueError, match="another setup.*model: store has"):
        LLM(str(b), kv_store_dir=str(root), **ARGS)

    def no_reading(path):
        raise AssertionError(f"{path} read again")
    monkeypatch.setattr(weight_digests, "hash_file", no_reading)
    LLM(str(a), kv_store_dir=str(root), **ARGS)  # a second start reads no weights: cached


def test_params_fingerprint_covers_every_element():
    """Params from no file (a preset's random weights) are hashed from their arrays; host
    (numpy) params give the same fingerprint as the loaded ones."""
    loaded = load_model("tiny_llama")
    base = model_fingerprint(loaded.cfg, loaded.params, jnp.float32)
    changed = jax.tree.map(lambda x: x, loaded.params)
    embed = changed["embed"]
    changed["embed"] = embed.at[embed.shape[0] // 2, embed.shape[1] // 2].add(1e-3)
    assert model_fingerprint(loaded.cfg, changed, jnp.float32) != base
    host = jax.tree.map(np.asarray, loaded.params)
    assert model_fingerprint(loaded.cfg, host, jnp.float32) == base


def test_file_digests_are_cached_by_file_identity(tmp_path, monkeypatch):
    files = weight_files(_checkpoint(tmp_path / "a"))
    first = file_digests(files, tmp_path)
    real, read = weight_digests.hash_file, []
    monkeypatch.setattr(weight_digests, "hash_file", lambda p: read.append(p) or real(p))
    assert file_digests(files, tmp_path) == first and read == []
    tensors = safetensors.numpy.load_file(files[0])
    tensors[EMBED][110, 16] += 1e-3  # the same size, rewritten in place
    safetensors.numpy.save_file(tensors, files[0])
    again = file_digests(files, tmp_path)
    assert read == [files[0].resolve()] and again != first
    (tmp_path / weight_digests.CACHE_NAME).write_text("[1, 2")  # damaged: hashed again
    assert file_digests(files, tmp_path) == again and len(read) == 2
