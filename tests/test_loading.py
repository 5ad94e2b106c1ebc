"""Loading HF folders and presets: errors, sharding, orbax param cache, config parsing, tokenizers."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES
from safetensors.numpy import save_file

from configs.presets import PRESETS, get_preset
from minipic_jax.loading import ByteTokenizer, Llama3Tokenizer, load_model, load_tokenizer
from minipic_jax.loading.safetensors_io import SafetensorsReader, weight_files
from minipic_jax.models import get_family, llama
from serving.step import sharding
from serving.tiers.fingerprint import model_fingerprint


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _tensors(folder):
    reader = SafetensorsReader(weight_files(folder))
    return {n: np.array(reader.get(n)) for n in reader.names()}


def _rewrite(folder, tensors):
    for f in weight_files(folder):
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))


def _equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("model", ["no-such-preset", "/no/such/folder"])
def test_unknown_preset_or_folder_lists_presets(model):
    with pytest.raises(ValueError, match="tiny_llama3") as err:
        load_model(model)
    assert model in str(err.value)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "llama_mha" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load_model(tmp_path)


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("edit, pattern", [
    ({"model_type": "gpt2"}, "'gpt2'.*llama"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
])
def test_unsupported_config_is_named(tmp_path, edit, pattern):
    folder = _copy("llama_mha", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=pattern):
        load_model(folder)


def test_generation_config_eos_ids_are_added(tmp_path):
    folder = _copy("llama_mha", tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 257]}))
    m = load_model(folder)
    assert m.cfg.eos_token_ids == (257, 258) and m.tokenizer.eos_token_ids == (257, 258)


def test_mistral_sliding_window_is_rejected(tmp_path):
    folder = _copy("mistral_gqa4", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "sliding_window": 1024}))
    with pytest.raises(ValueError, match="sliding_window=1024"):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "sliding_window": 1 << 20}))
    assert load_model(folder).cfg.model_type == "mistral"  # window >= context: plain attention


def test_missing_tensor_is_named(tmp_path, fresh_rng):
    folder = _copy("llama_gqa2_llama3rope", tmp_path)
    tensors = _tensors(folder)
    victim = sorted(tensors)[int(fresh_rng.integers(len(tensors)))]
    del tensors[victim]
    _rewrite(folder, tensors)
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        load_model(folder)


def test_mismatched_tensor_shape_is_named(tmp_path):
    folder = _copy("llama_gqa2_llama3rope", tmp_path)
    tensors = _tensors(folder)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = np.zeros((tensors[name].shape[0] + 8, tensors[name].shape[1]), np.float32)
    _rewrite(folder, tensors)
    with pytest.raises(ValueError, match=r"k_proj.*\(24, 32\).*expected \(16, 32\)"):
        load_model(folder)


def test_bad_dtype():
    with pytest.raises(ValueError, match="float16"):
        load_model("tiny-llama", dtype="float16")


def test_registry_names_supported_types():
    with pytest.raises(ValueError, match="gpt_neox.*llama.*mistral.*qwen3_5"):
        get_family("gpt_neox")
    assert get_family("mistral") is llama


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("name", ["llama_mha", "llama_gqa4_tied_hd16", "mistral_gqa4"])
def test_converter_reads_every_checkpoint_tensor(name):
    """No weight in an HF checkpoint is silently ignored (e.g. a bias we do not model)."""
    m = load_model(FIXTURES / name)
    names = SafetensorsReader(weight_files(FIXTURES / name)).names()
    assert sorted(m.family.hf_tensor_names(m.cfg)) == sorted(names)


def test_sharded_and_single_file_give_identical_params(tmp_path):
    sharded = FIXTURES / "llama_gqa4_tied_hd16"
    assert (sharded / "model.safetensors.index.json").exists() and len(weight_files(sharded)) > 1
    single = _copy("llama_gqa4_tied_hd16", tmp_path)
    _rewrite(single, _tensors(sharded))
    assert _equal(load_model(sharded).params, load_model(single).params)


def test_bf16_checkpoint_loads(tmp_path):
    import ml_dtypes
    folder = _copy("llama_mha", tmp_path)
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors(folder).items()}
    _rewrite(folder, tensors)
    m = load_model(folder, dtype="bfloat16")
    want = tensors["model.layers.0.self_attn.q_proj.weight"]  # [H*D, E]
    e, h, d = m.cfg.hidden_size, m.cfg.num_heads, m.cfg.head_dim
    np.testing.assert_array_equal(np.asarray(m.params["layers"][0]["wq"]), want.T.reshape(e, h, d))
    assert m.params["embed"].dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["llama_gqa4_tied_hd16", "qwen3_5_gva2"])
def test_host_views_stream_to_the_loaded_params(name):
    """load_model(host=True), what tensor parallelism streams to its devices: views of the mapped
    checkpoint (nothing copied) equal to the loaded params; streamed (KV heads repeated twice,
    cast to bfloat16) they equal the loaded bfloat16 params so placed; the span store's
    fingerprint is the same from either. Multi-device streaming: tests/test_tensor_parallel.py."""
    host = load_model(FIXTURES / name, host=True)
    assert all(isinstance(x, np.ndarray) and not x.flags.owndata
               for x in jax.tree.leaves(host.params))
    assert _equal(load_model(FIXTURES / name, cache_dir=False).params, host.params)  # float32
    loaded = load_model(FIXTURES / name, dtype="bfloat16", cache_dir=False)
    axes = host.family.param_axes(host.cfg)
    want = sharding.replicate_kv_heads(loaded.params, axes, 2)
    got = sharding.stream_params(host.params, axes, sharding.make_mesh(1), jnp.bfloat16,
                                 copies=2)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert (model_fingerprint(host.cfg, host.params, jnp.bfloat16) ==
            model_fingerprint(loaded.cfg, loaded.params, jnp.bfloat16))


def test_old_style_rope_scaling_config_parses_the_same():
    hf = json.loads((FIXTURES / "llama_gqa2_llama3rope" / "config.json").read_text())
    new = llama.config_from_hf(hf)
    params = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")  # the oldest key name
    hf["rope_scaling"] = params
    assert llama.config_from_hf(hf) == new


# ----------------------------------------------------------------------------- orbax cache


def test_orbax_cache_round_trip_and_invalidation(tmp_path):
    folder = _copy("llama_gqa2_llama3rope", tmp_path / "models")
    cache = tmp_path / "cache"
    first = load_model(folder, cache_dir=cache)
    assert not first.from_cache and any(cache.iterdir())
    second = load_model(folder, cache_dir=cache)
    assert second.from_cache and _equal(first.params, second.params)
    assert jax.tree.structure(first.params) == jax.tree.structure(second.params)
    # a different dtype is a different entry
    bf = load_model(folder, cache_dir=cache, dtype="bfloat16")
    assert not bf.from_cache
    bf2 = load_model(folder, cache_dir=cache, dtype="bfloat16")
    assert bf2.from_cache and bf2.params["embed"].dtype == jnp.bfloat16
    # changed weights invalidate the entry
    tensors = _tensors(folder)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    _rewrite(folder, tensors)
    st = (folder / "model.safetensors").stat()
    os.utime(folder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = load_model(folder, cache_dir=cache)
    assert not third.from_cache
    np.testing.assert_array_equal(np.asarray(third.params["final_norm"]),
                                  2 * np.asarray(first.params["final_norm"]))


# ----------------------------------------------------------------------------- presets


def test_presets_are_deterministic_and_shaped():
    a = load_model("tiny-llama", seed=3)
    b = load_model("tiny_llama", seed=3)
    c = load_model("TINY-LLAMA", seed=4)
    assert _equal(a.params, b.params) and not _equal(a.params, c.params)
    assert a.params["embed"].shape == (512, 64)
    for name, cfg in PRESETS.items():
        assert get_preset(name) is cfg
    assert get_preset("llama3.1-8b") == get_preset("tulu3_block_ft")
    q = get_preset("qwen3_5_0_8b")
    assert q.num_layers == 24 and q.hidden_size == 1024 and q.rotary_dim == 64
    assert q.layer_types == ("linear_attention",) * 3 + ("full_attention",) + q.layer_types[4:]
    assert q.layer_types.count("full_attention") == 6 and q.layer_types[3::4] == (
        "full_attention",) * 6
    shapes = jax.eval_shape(lambda: llama.init_params(get_preset("llama3_8b"), jax.random.key(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert 8.0e9 < n < 8.1e9  # Llama-3-8B has 8.03B parameters


# ----------------------------------------------------------------------------- tokenizers


def test_llama3_tokenizer_known_ids_and_round_trip(fresh_rng):
    tok = load_model("tiny-llama3").tokenizer
    assert isinstance(tok, Llama3Tokenizer) and tok.vocab_size == 128256
    # ids documented with the data set (shared/data/README.md) and Meta's model card
    assert tok.encode("<")[1:] == [27] and tok.encode("+")[1:] == [10] and tok.encode("@")[1:] == [31]
    assert tok.encode("Hello world") == [128000, 9906, 1917]
    assert tok.encode("<|eot_id|>") == [128000, 128009]
    assert tok.eos_token_ids == (128001, 128008, 128009)
    alphabet = list("abcxyz ,.!?\n\t0123456789") + ["é", "ü", "中", "文", "🙂", "<|", "|>"]
    text = "".join(fresh_rng.choice(alphabet, 200))
    ids = tok.encode(text)
    assert ids[0] == 128000 and max(ids[1:]) < 128000
    assert tok.decode(ids) == text


def test_byte_tokenizer_for_tiny_vocab():
    m = load_model(FIXTURES / "llama_mha")
    tok = m.tokenizer
    assert isinstance(tok, ByteTokenizer)
    assert tok.bos_token_id == 256 and tok.eos_token_ids == (257,)
    assert tok.encode("hé") == [256, 104, 195, 169]
    assert tok.decode([256, 104, 195, 169, 257]) == "hé"
    cfg = get_preset("tiny-llama")
    assert load_tokenizer(None, cfg).vocab_size == 512


def test_hf_tokenizer_files_are_used(tmp_path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    folder = _copy("llama_mha", tmp_path)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    tok = load_model(folder).tokenizer
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([3, 4]) == "hello world"
    assert 1 in tok.eos_token_ids and 257 in tok.eos_token_ids
