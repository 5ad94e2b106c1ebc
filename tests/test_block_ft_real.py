"""The real-model block fine-tuning recipe (`minipic-bench block-ft --model <folder>`,
benchmarks/block_ft_real.py): its data, and one tiny run of the whole recipe on a preset exported
as a folder (evaluate, one training update, export, evaluate, report)."""

from __future__ import annotations

import json

import jax
import pytest

from benchmarks import block_ft_bench, block_ft_real, block_ft_real_data as data
from benchmarks.block_ft_real_prompt import chat_segments


def test_train_and_held_out_entities_are_disjoint():
    train, held = data.name_pools(0)
    for a, b in ((train.places, held.places), (train.given, held.given),
                 (train.family, held.family)):
        assert a and b and not set(a) & set(b)
    names = set(train.places) | set(train.given) | set(train.family)
    for q in data.held_out_questions(0, 50):
        for word in " ".join(q.passages).replace(".", " ").replace(",", " ").split():
            assert word not in names, f"training name {word!r} in a held-out passage"


@pytest.mark.parametrize("make", [lambda: data.train_questions(3, 40),
                                  lambda: data.held_out_questions(3, 40)])
def test_questions_have_one_answering_passage(make):
    questions = make()
    assert questions == make()  # deterministic from the seed
    for q in questions:
        assert len(q.passages) == 4
        holders = [k for k, p in enumerate(q.passages) if data.correct(p, q.answer)]
        assert holders == [q.gold_index], (q, holders)
    assert len({q.gold_index for q in questions}) == 4  # the answer is not always in one place


def test_held_out_passages_repeat_across_questions():
    qs = data.held_out_questions(0, 60)
    seen = [p for q in qs for p in q.passages]
    assert len(set(seen)) < len(seen) / 2  # the span run reuses them from the cache


def test_chat_segments_are_a_chat_turn_with_one_span_per_passage():
    segs = chat_segments(("one.", "two."), "Who?")
    assert [s["kind"] for s in segs] == ["prompt", "span", "span", "prompt"]
    assert segs[0]["text"].startswith("<|im_start|>system\n")
    assert segs[-1]["text"].endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_bad_options_are_named_before_any_work(tmp_path):
    p = _parser()
    args = p.parse_args(["--model", str(tmp_path), "--passages", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--passages"):
        block_ft_real.resolve(args)
    args = p.parse_args(["--model", str(tmp_path / "x.gguf")])
    with pytest.raises(ValueError, match="x.gguf"):
        block_ft_real.resolve(args)


def test_a_prompt_longer_than_seq_len_is_named_before_any_work(tmp_path, capsys):
    folder = _tiny_folder(tmp_path)
    out = tmp_path / "run"
    args = _parser().parse_args(["--model", str(folder), "--out", str(out), "--seq-len", "150",
                                 "--passages", "2", "--train-questions", "3", "--steps", "1"])
    assert block_ft_bench.run(args) == 2
    assert "training record 0 lays out to" in capsys.readouterr().err
    assert not (out / "train.jsonl").exists()  # nothing was started


def _tiny_folder(tmp_path):
    from configs.presets import get_preset
    from minipic_jax.models import llama
    from minipic_jax.training.export import export_hf
    cfg = get_preset("tiny_llama3")
    return export_hf(llama.init_params(cfg, jax.random.key(0)), cfg, llama, tmp_path / "base")


def _parser():
    import argparse
    p = argparse.ArgumentParser()
    block_ft_bench.add_parser(p)
    return p


def test_recipe_runs_end_to_end_on_a_tiny_folder(tmp_path):
    folder = _tiny_folder(tmp_path)
    out = tmp_path / "run"
    args = _parser().parse_args([
        "--model", str(folder), "--out", str(out), "--steps", "1", "--batch-size", "2",
        "--eval-questions", "3", "--train-questions", "4", "--passages", "2", "--seq-len", "256",
        "--max-tokens", "2", "--no-progress"])
    assert block_ft_bench.run(args) == 0
    res = json.loads((out / "block_ft_real.json").read_text())
    for phase in ("before", "after"):
        for mode in ("full", "spans"):
            assert 0.0 <= res[phase][mode]["accuracy"] <= 1.0
        # the system turn is shared by every prompt: later span prompts read it from the cache
        assert res[phase]["spans"]["cached_share"] > 0.2
    assert res["train_records"] == 4
    assert len((out / "train.jsonl").read_text().splitlines()) == 4
    assert res["fine_tune"]["compute_dtype"] == "float32"  # auto on a CPU
    assert (out / "run" / "export" / "model.safetensors").exists()
    assert "after fine-tuning" in (out / "block_ft_real.md").read_text()
    assert set(res["phases_s"]) == {"convert", "data", "eval_before", "fine_tune", "eval_after"}


def test_export_keeps_the_source_chat_template(tmp_path):
    """transformers 5 saves a chat template as chat_template.jinja beside tokenizer_config.json;
    an export without it could not be served as a chat model (LLM.chat, /v1/chat/completions)."""
    import numpy as np

    from minipic_jax.training.export import export_hf
    src = _tiny_folder(tmp_path)
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    from configs.presets import get_preset
    from minipic_jax.models import llama
    cfg = get_preset("tiny_llama3")
    params = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(1)))
    out = export_hf(params, cfg, llama, tmp_path / "export", source_folder=src)
    assert (out / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"
