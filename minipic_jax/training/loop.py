"""Block-attention fine-tuning: the run (config, resume, steps, metrics, checkpoints, export)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from minipic_jax.loading import load_model
from minipic_jax.training import checkpoint
from minipic_jax.training.batch import BatchStream
from minipic_jax.training.data import Markers, layout_example, read_jsonl
from minipic_jax.training.export import export_hf
from minipic_jax.training.optim import init_lora, make_optimizer, merge_lora
from minipic_jax.training.step import make_train_step, max_loss_rows
from serving.config import default_marker_ids, marker_embedding_ids

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str  # HF folder, cached repo id or preset (as LLM(model=...))
    data: str  # JSONL path
    out_dir: str  # checkpoints/, metrics.jsonl and export/ go here
    steps: int = 100  # optimizer updates
    batch_size: int = 8  # examples per micro-step
    grad_accum: int = 1  # micro-steps per update
    seq_len: int = 512  # L: examples are right-padded to it
    lr: float = 1e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 16.0
    plain_fraction: float = 0.0  # share of examples laid out without blocks (full attention)
    block_size: int = 16  # the engine's block_size the model will be served with
    compute_dtype: str = "bfloat16"  # fp32 master weights, this in the forward/backward
    # "dots" (the default: projection outputs kept, the rest recomputed; 49.6% MFU against 42.8%
    # for "full" on the H200, benchmarks/RESULTS.md "Training"), "full" (least memory) or "none";
    # True/False accepted (models/llama_train.py)
    remat: str = "dots"
    attn_impl: str = "auto"  # "auto" (cuDNN on a GPU in bf16), "xla" or "cudnn"
    seed: int = 0
    checkpoint_every: int = 50  # updates; 0: only at the end
    export_dtype: str = "bfloat16"
    progress: bool = True

    def __post_init__(self):
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.plain_fraction <= 1.0:
            raise ValueError(f"TrainConfig.plain_fraction must be in [0, 1], got "
                             f"{self.plain_fraction}")
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"TrainConfig.compute_dtype must be one of {tuple(DTYPES)}")
        if self.attn_impl not in ("auto", "xla", "cudnn"):
            raise ValueError(f"TrainConfig.attn_impl must be 'auto', 'xla' or 'cudnn', got "
                             f"{self.attn_impl!r}")
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in ("full", "dots", "none"):
            raise ValueError(f"TrainConfig.remat must be 'full', 'dots' or 'none', got "
                             f"{self.remat!r}")


def trainable_family(loaded):
    fam = loaded.family
    if not hasattr(fam, "training_forward"):
        raise ValueError(f"model family {fam.__name__.rsplit('.', 1)[-1]} ({loaded.cfg.model_type})"
                         f" cannot be trained: it has no training_forward; trainable families: "
                         f"llama, mistral")
    return fam


def engine_markers(loaded, block_size: int) -> Markers:
    """The engine's default marker ids for this model (serving/config.py, same reserved ids)."""
    cfg, tok = loaded.cfg, loaded.tokenizer
    reserved = set(cfg.eos_token_ids) | set(getattr(tok, "eos_token_ids", ()) or ())
    reserved |= {i for i in (cfg.bos_token_id, getattr(tok, "bos_token_id", None)) if i is not None}
    ids = default_marker_ids(cfg.vocab_size)
    rows = marker_embedding_ids(ids, cfg.vocab_size, reserved)
    return Markers(block_size=block_size, embedding_ids=tuple(sorted(rows.items())), **ids)


class Trainer:
    """Holds the model, data and optimizer of one run; `run()` trains (resuming if it can)."""

    def __init__(self, tc: TrainConfig):
        self.tc = tc
        self.out = pathlib.Path(tc.out_dir)
        self.loaded = load_model(tc.model, dtype="float32", seed=tc.seed, cache_dir=False)
        self.family = trainable_family(self.loaded)
        self.cfg = self.loaded.cfg
        self.records = read_jsonl(tc.data)
        self.markers = engine_markers(self.loaded, tc.block_size)
        eos = self.cfg.eos_token_ids
        self._eos = eos[0] if eos else None
        self._examples: dict = {}
        opt = dict(lr=tc.lr, total_steps=tc.steps, warmup_steps=tc.warmup_steps,
                   min_lr_ratio=tc.min_lr_ratio, weight_decay=tc.weight_decay,
                   clip_norm=tc.clip_norm, grad_accum=tc.grad_accum)
        self.tx = make_optimizer(**opt)
        base = self.loaded.params
        if tc.lora_rank:
            self.frozen = jax.tree.map(lambda w: w.astype(DTYPES[tc.compute_dtype]), base)
            trainable = init_lora(base, tc.lora_rank, jax.random.key(tc.seed))
        else:
            self.frozen, trainable = None, base
        answers = [int(self.example(i, plain=tc.plain_fraction >= 1.0).loss_mask.sum())
                   for i in range(len(self.records))]  # every record laid out (and checked) first
        lora = tc.lora_alpha if tc.lora_rank else None
        self.step_fn = make_train_step(self.family, self.cfg, tuple(sorted(opt.items())),
                                       lora_alpha=lora, compute_dtype=DTYPES[tc.compute_dtype],
                                       remat=tc.remat, attn_impl=tc.attn_impl,
                                       loss_rows=max_loss_rows(answers, tc.batch_size))
        # committed like a restored checkpoint's arrays, so a resumed run reuses the compiled step
        self.state = jax.device_put({"trainable": trainable, "opt_state": self.tx.init(trainable)},
                                    jax.devices()[0])

    def example(self, index: int, plain: bool):
        key = (index, plain)
        if key not in self._examples:
            ex = layout_example(self.records[index], self.markers, self.loaded.tokenizer,
                                eos_token_id=self._eos, plain=plain,
                                where=f"{self.tc.data}:record {index}")
            if len(ex.tokens) > self.tc.seq_len:
                raise ValueError(f"{self.tc.data}: record {index} lays out to {len(ex.tokens)} "
                                 f"tokens (with markers, pads and answer), more than seq_len="
                                 f"{self.tc.seq_len}; raise seq_len or shorten it")
            self._examples[key] = ex
        return self._examples[key]

    def _meta(self, update: int, position: int) -> dict:
        cfg = dataclasses.asdict(self.tc)
        for k in ("out_dir", "progress", "checkpoint_every"):
            cfg.pop(k)
        return {"update": update, "data_position": position, "config": cfg}

    def _resume(self):
        got = checkpoint.latest(self.out / "checkpoints", self.state)
        if got is None:
            return 0, 0
        _, state, meta = got
        want = self._meta(0, 0)["config"]
        if meta["config"] != want:
            diff = sorted(k for k in want if meta["config"].get(k) != want[k])
            raise ValueError(f"{self.out}/checkpoints was written with different arguments "
                             f"({', '.join(diff)}); use a new out_dir or the same arguments")
        self.state = state
        return int(meta["update"]), int(meta["data_position"])

    def run(self, on_update=None) -> list[dict]:
        """Train to tc.steps updates (resuming from the newest checkpoint). on_update(update,
        metrics) is called after each update. Returns this call's per-update metrics."""
        tc = self.tc
        self.out.mkdir(parents=True, exist_ok=True)
        update, position = self._resume()
        stream = BatchStream(len(self.records), self.example, batch_size=tc.batch_size,
                             seq_len=tc.seq_len, seed=tc.seed, plain_fraction=tc.plain_fraction,
                             start=position)
        history = []
        bar = _progress(tc.steps, update, tc.progress)
        with open(self.out / "metrics.jsonl", "a") as log:
            while update < tc.steps:
                t0 = time.perf_counter()
                losses, tokens = [], 0
                for _ in range(tc.grad_accum):
                    batch = stream.next()
                    tokens += int(batch.valid.sum())
                    self.state, m = self.step_fn(self.state, self.frozen, batch)
                    losses.append(m["loss"])
                loss = float(np.mean([float(x) for x in losses]))
                update += 1
                rec = {"update": update, "loss": loss, "grad_norm": float(m["grad_norm"]),
                       "tokens": tokens, "tokens_per_s": tokens / (time.perf_counter() - t0)}
                history.append(rec)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                if (tc.checkpoint_every and update % tc.checkpoint_every == 0) or update == tc.steps:
                    checkpoint.save(self.out / "checkpoints", update, self.state,
                                    self._meta(update, stream.position))
                if on_update is not None:
                    on_update(update, rec)
        bar.close()
        return history

    def params(self) -> dict:
        """The trained params (LoRA merged), fp32."""
        if self.tc.lora_rank:
            return merge_lora(self.loaded.params, self.state["trainable"], self.tc.lora_alpha)
        return self.state["trainable"]

    def export(self, out_dir=None) -> pathlib.Path:
        source = self.loaded.source
        folder = source[len("folder:"):] if source.startswith("folder:") else None
        return export_hf(self.params(), self.cfg, self.family, out_dir or self.out / "export",
                         source_folder=folder, dtype=self.tc.export_dtype)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, desc="minipic-train",
                unit="update")


def train(tc: TrainConfig, on_update=None) -> pathlib.Path:
    """Run (or resume) a fine-tuning and export the result; returns the export folder."""
    trainer = Trainer(tc)
    trainer.run(on_update)
    return trainer.export()
