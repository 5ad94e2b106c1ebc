"""Block-attention fine-tuning (train as you serve): the engine's model, masks and positions on
dense batches, optax AdamW, orbax checkpoints with exact resume, HF export. CLI: minipic-train."""

from minipic_jax.training.data import Example, Markers, Record, layout_example, read_jsonl
from minipic_jax.training.export import export_hf
from minipic_jax.training.loop import TrainConfig, Trainer, train

__all__ = ["Example", "Markers", "Record", "TrainConfig", "Trainer", "export_hf",
           "layout_example", "read_jsonl", "train"]
