"""minipic_jax.training: data errors, exact resume from orbax checkpoints, LoRA, HF export that
the engine loads with the trained logits. (Training forward correctness: test_training_forward.)"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import FIXTURES

from minipic_jax.loading import load_model
from minipic_jax.models import llama, testing
from minipic_jax.training import TrainConfig, Trainer, read_jsonl
from minipic_jax.training.cli import main as train_cli


def _write_data(path, seed, n=8):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ids = lambda lo, hi: rng.integers(0, 250, int(rng.integers(lo, hi))).tolist()
    with open(path, "w") as f:
        for _ in range(n):
            segs = [{"kind": "prompt", "tokens": ids(2, 6)}, {"kind": "span", "tokens": ids(3, 12)},
                    {"kind": "span", "text": "doc"}, {"kind": "prompt", "text": "q?"}]
            f.write(json.dumps({"segments": segs, "answer": ids(1, 4)}) + "\n")
    return path


def _config(tmp_path, seed, **kw):
    args = dict(model="tiny_llama", data=str(_write_data(tmp_path / "d.jsonl", seed)),
                out_dir=str(tmp_path / "run"), steps=4, batch_size=2, grad_accum=2, seq_len=64,
                lr=3e-3, warmup_steps=1, checkpoint_every=2, progress=False, seed=seed,
                plain_fraction=0.5)
    return TrainConfig(**{**args, **kw})


@pytest.mark.parametrize("line, field", [
    ('{"segments": [{"kind": "prompt", "text": "a"}]}', "answer: missing"),
    ('{"segments": [], "answer": "a"}', "segments: expected a non-empty list"),
    ('{"segments": [{"kind": "doc", "text": "a"}], "answer": "a"}', "segments[0].kind"),
    ('{"segments": [{"kind": "span", "tokens": [1, -2]}], "answer": "a"}', "segments[0].tokens"),
    ('{"segments": [{"kind": "span", "text": "a", "tokens": [1]}], "answer": "a"}',
     "exactly one of"),
    ('{"segments": [{"kind": "span", "text": "a"}], "answer": []}', "answer: expected"),
    ('[1, 2]', "expected a JSON object"),
    ('{"segments": [', "not valid JSON"),
])
def test_bad_records_name_line_and_field(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"segments": [{"kind": "prompt", "text": "ok"}], "answer": "x"}\n\n' + line)
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3.*{_re(field)}"):
        read_jsonl(path)


def _re(s):
    import re
    return re.escape(s)


def test_untrainable_family_and_overlong_records_are_refused(tmp_path):
    cfg = _config(tmp_path, 0, model=str(FIXTURES / "qwen3_5_tied"))
    with pytest.raises(ValueError, match="cannot be trained"):
        Trainer(cfg)
    with pytest.raises(ValueError, match=r"d\.jsonl: record \d+ lays out to \d+ tokens.*seq_len"):
        Trainer(_config(tmp_path, 0, seq_len=16))
    assert train_cli(["--model", "tiny_llama", "--data", str(tmp_path / "none.jsonl"), "--out",
                      str(tmp_path / "o"), "--no-progress"]) == 2


def test_killed_run_resumes_bitwise_and_exports_for_the_engine(tmp_path):
    """4 updates straight vs killed after update 3 (last checkpoint: update 2) and re-run: the
    same losses bit for bit. The export loads in the engine with the trained model's logits."""
    seed = 11
    full = Trainer(_config(tmp_path / "a", seed))
    want = [r["loss"] for r in full.run()]
    assert want[-1] < want[0]
    assert all(w.dtype == np.float32 for w in jax.tree.leaves(full.state["trainable"]))

    def kill(update, _):
        if update == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        Trainer(_config(tmp_path / "b", seed)).run(kill)
    resumed = Trainer(_config(tmp_path / "b", seed))
    got = [r["loss"] for r in resumed.run()]
    assert got == want[2:]
    logged = [json.loads(s)["loss"] for s in (tmp_path / "b" / "run" / "metrics.jsonl")
              .read_text().splitlines()]
    assert logged == want[:3] + want[2:]  # update 3 ran twice: before the kill and after resume

    folder = full.export(tmp_path / "export")
    trained = full.params()
    m = load_model(folder, dtype="float32")
    assert m.cfg == full.cfg
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    got = testing.prefill_logits(llama, m.params, m.cfg, prompts)
    ref = testing.prefill_logits(llama, trained, full.cfg, prompts)
    for g, r in zip(got, ref):  # bf16 export (load_model is what LLM(model=folder) calls)
        assert np.abs(g - r).max() < 0.05 * np.abs(r).max()


def test_lora_trains_only_the_factors_and_merges_on_export(tmp_path):
    trainer = Trainer(_config(tmp_path, 3, lora_rank=4, steps=2, checkpoint_every=0,
                              export_dtype="float32", plain_fraction=0.0, remat=False,
                              compute_dtype="float32"))
    base = jax.tree.map(np.asarray, trainer.loaded.params)
    hist = trainer.run()
    assert len(hist) == 2 and set(trainer.state["trainable"]) == {"layers"}
    merged = trainer.params()
    moved = np.abs(np.asarray(merged["layers"][0]["wq"]) - base["layers"][0]["wq"]).max()
    assert moved > 0
    np.testing.assert_array_equal(np.asarray(merged["embed"]), base["embed"])  # not a target
    m = load_model(trainer.export(), dtype="float32")
    np.testing.assert_array_equal(np.asarray(m.params["layers"][1]["w_down"]),
                                  np.asarray(merged["layers"][1]["w_down"]))
