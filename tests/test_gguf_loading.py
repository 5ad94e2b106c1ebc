"""Loading Llama GGUF checkpoints written here the way llama.cpp's converter writes them: params
(every supported tensor type, q/k row order undone), config and tokenizer from the metadata, the
orbax cache, and each bad input named before any tensor is dequantized."""

import jax
import numpy as np
import pytest
from gguf_files import random_hf_tensors, set_tensor_type_id, tiny_cfg, write_llama_gguf

from minipic_jax.loading import load_model
from minipic_jax.loading.gguf_reader import SUPPORTED_TYPES, GGUFError, GGUFFile
from minipic_jax.models import llama

TYPES = {  # one layer's tensors in every supported type; layer 1 stays F32 (exact)
    "model.embed_tokens.weight": "Q6_K", "model.layers.0.self_attn.q_proj.weight": "Q4_K",
    "model.layers.0.self_attn.k_proj.weight": "Q8_0", "model.layers.0.self_attn.v_proj.weight":
    "Q4_0", "model.layers.0.self_attn.o_proj.weight": "Q4_1",
    "model.layers.0.mlp.gate_proj.weight": "F16", "model.layers.0.mlp.up_proj.weight": "BF16"}


def _equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture
def tiny_gguf(tmp_path, fresh_rng):
    cfg = tiny_cfg()
    hf = random_hf_tensors(cfg, fresh_rng)
    held = write_llama_gguf(tmp_path / "tiny.gguf", cfg, hf, TYPES, rng=fresh_rng)
    return tmp_path / "tiny.gguf", cfg, hf, held


def test_every_type_loads_with_hf_row_order(tiny_gguf):
    path, cfg, hf, held = tiny_gguf
    assert set(TYPES.values()) == set(SUPPORTED_TYPES) - {"F32"}
    loaded = load_model(path, cache_dir=False)
    assert loaded.cfg == cfg and loaded.source == f"gguf:{path.resolve()}"
    # F32 tensors (layer 1's q/k among them) come back exactly as HF's: the permutation is undone
    f32 = {n: t for n, t in hf.items() if n not in TYPES}
    assert all(np.array_equal(held[n], f32[n]) for n in f32)
    assert _equal(loaded.params, llama.convert_hf(held.__getitem__, cfg))
    quantized = np.asarray(loaded.params["layers"][0]["wv"])
    assert 0 < np.abs(quantized - hf["model.layers.0.self_attn.v_proj.weight"].T.reshape(
        quantized.shape)).max() < 0.2  # Q4_0 of N(0, 0.2) weights: close, not exact


def test_host_params_stream_to_the_loaded_params(tiny_gguf):
    path = tiny_gguf[0]
    host = load_model(path, host=True)  # tensor parallelism streams these to the devices
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(host.params))
    assert _equal(host.params, load_model(path, cache_dir=False).params)


def test_folder_with_one_gguf_and_bfloat16(tiny_gguf):
    path, cfg, _, held = tiny_gguf
    loaded = load_model(path.parent, dtype="bfloat16", cache_dir=False)
    assert loaded.params["embed"].dtype == jax.numpy.bfloat16
    assert _equal(loaded.params, llama.convert_hf(held.__getitem__, cfg, jax.numpy.bfloat16))
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \['other.gguf', 'tiny.gguf'\]"):
        load_model(path.parent, cache_dir=False)


def test_orbax_cache_round_trip(tiny_gguf, tmp_path):
    path = tiny_gguf[0]
    first = load_model(path, cache_dir=tmp_path / "cache")
    second = load_model(path, cache_dir=tmp_path / "cache")
    assert not first.from_cache and second.from_cache
    assert _equal(first.params, second.params)


def test_untied_output_and_config_keys(tmp_path, fresh_rng):
    cfg = tiny_cfg(tie_word_embeddings=False, num_layers=1, max_position_embeddings=300)
    hf = random_hf_tensors(cfg, fresh_rng)
    write_llama_gguf(tmp_path / "m.gguf", cfg, hf)
    loaded = load_model(tmp_path / "m.gguf", cache_dir=False)
    assert loaded.cfg == cfg
    np.testing.assert_array_equal(loaded.params["lm_head"], hf["lm_head.weight"].T)


def _spy_dequantize(monkeypatch):
    calls = []
    monkeypatch.setattr(GGUFFile, "tensor", lambda self, name: calls.append(name))
    return calls


def test_truncated_file_is_named_before_any_work(tiny_gguf, tmp_path, monkeypatch):
    path = tiny_gguf[0]
    data = path.read_bytes()
    calls = _spy_dequantize(monkeypatch)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 1000])
    with pytest.raises(GGUFError, match=r"cut.gguf: truncated GGUF: the file is \d+ bytes but "
                                        r"its tensors need \d+ \(1000 bytes missing\); 1 of 20 "
                                        r"tensors are cut or absent, the first "
                                        r"'blk.1.ffn_down.weight'"):
        load_model(cut, cache_dir=False)
    cut.write_bytes(data[:300])
    with pytest.raises(GGUFError, match=r"cut.gguf: truncated GGUF: the file ends \(300 bytes\) "
                                        r"inside the header, while reading"):
        load_model(cut, cache_dir=False)
    assert calls == []


def test_other_architecture_is_named(tmp_path, fresh_rng, monkeypatch):
    cfg = tiny_cfg(num_layers=1)
    write_llama_gguf(tmp_path / "q.gguf", cfg, random_hf_tensors(cfg, fresh_rng), arch="qwen2")
    calls = _spy_dequantize(monkeypatch)
    with pytest.raises(GGUFError, match=r"q.gguf: GGUF architecture 'qwen2' is not supported"):
        load_model(tmp_path / "q.gguf", cache_dir=False)
    assert calls == []


@pytest.mark.parametrize("type_id, shown", [(99, "unknown type id 99"), (13, "Q5_K")])
def test_unsupported_tensor_type_is_named(tiny_gguf, monkeypatch, type_id, shown):
    path = tiny_gguf[0]
    set_tensor_type_id(path, "blk.1.ffn_down.weight", type_id)
    calls = _spy_dequantize(monkeypatch)
    with pytest.raises(GGUFError, match=rf"tensor 'blk.1.ffn_down.weight' has quantization type "
                                        rf"{shown}, which this loader does not dequantize"):
        load_model(path, cache_dir=False)
    assert calls == []


def test_not_a_gguf_and_missing_tensor(tmp_path, fresh_rng):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFError, match=r"x.gguf: not a GGUF file"):
        load_model(tmp_path / "x.gguf")
    cfg = tiny_cfg(num_layers=1)
    hf = random_hf_tensors(cfg, fresh_rng)
    write_llama_gguf(tmp_path / "m.gguf", tiny_cfg(num_layers=1), hf)
    data = (tmp_path / "m.gguf").read_bytes().replace(b"blk.0.ffn_up.weight",
                                                     b"blk.0.ffn_xx.weight")
    (tmp_path / "m.gguf").write_bytes(data)
    with pytest.raises(GGUFError, match=r"missing tensor\(s\) \['blk.0.ffn_up.weight'\]"):
        load_model(tmp_path / "m.gguf", cache_dir=False)


def test_tensor_the_model_would_ignore_is_named(tmp_path, fresh_rng):
    cfg = tiny_cfg(num_layers=1)
    hf = random_hf_tensors(cfg, fresh_rng)
    bias = {"blk.0.attn_q.bias": np.ones(cfg.num_heads * cfg.head_dim, np.float32)}
    write_llama_gguf(tmp_path / "m.gguf", cfg, hf, extra=bias)
    with pytest.raises(GGUFError, match=r"has tensor\(s\) \['blk.0.attn_q.bias'\] that the "
                                        r"llama model does not read"):
        load_model(tmp_path / "m.gguf", cache_dir=False)


def _byte_level_vocab():
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = sorted(ByteLevel.alphabet())  # the 256 byte spellings
    tokens = alphabet + ["Ġt", "Ġth", "<|end|>", "<think>"]
    return {"tokens": tokens, "merges": ["Ġ t", "Ġt h"], "pre": "default",
            "token_type": [1] * 258 + [3, 4], "chat_template": "{{ messages }}"}


def test_tokenizer_from_metadata(tmp_path, fresh_rng):
    tok_fields = _byte_level_vocab()
    cfg = tiny_cfg(num_layers=1, vocab_size=260, bos_token_id=258, eos_token_ids=(258,))
    write_llama_gguf(tmp_path / "m.gguf", cfg, random_hf_tensors(cfg, fresh_rng),
                     tokenizer=tok_fields)
    tok = load_model(tmp_path / "m.gguf", cache_dir=False).tokenizer
    ids = tok.encode("a the<|end|><think>")
    vocab = {t: i for i, t in enumerate(tok_fields["tokens"])}
    assert ids == [vocab["a"], vocab["Ġth"], vocab["e"], 258, 259]  # no BOS: add_bos unset
    assert tok.decode(ids) == "a the<think>"  # the control token is dropped
    assert (tok.chat_template, tok.eos_token_ids, tok.eos_token) == ("{{ messages }}", (258,),
                                                                     "<|end|>")
