"""A GRPO-style RL loop with the engine doing the rollouts: the part of `minipic-bench rl` a JAX
user copies.

Per step: G samples of each of B prompts (`LLM.generate_arrays` with `n=G`: the samples share the
prompt's KV blocks), rewards from the task's checker, group-normalised advantages, one optax step
on the clipped policy loss (logprobs from the training forward, minipic_jax/models/llama_train.py,
against the engine's sampled-token logprobs as the old policy), then `LLM.update_weights`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import rl_task
from minipic_jax import LLM, SamplingParams
from minipic_jax.loading import load_model
from minipic_jax.training.rollout_logprobs import rollout_logprobs


@dataclasses.dataclass(frozen=True)
class RLConfig:
    task: str = "next_letter"
    steps: int = 150
    prompts_per_step: int = 16  # B
    samples: int = 8  # G
    max_tokens: int = 4  # T
    lr: float = 3e-3
    clip_eps: float = 0.2
    temperature: float = 1.0
    seed: int = 0


def grpo_advantages(rewards, num_samples: int):
    """[B * G] rewards -> [B * G] advantages: each group's rewards minus its mean, over its std."""
    r = rewards.reshape(-1, num_samples)
    adv = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-4)
    return adv.reshape(-1)


def policy_loss(params, cfg, batch: dict, num_samples: int, clip_eps: float):
    """PPO/GRPO clipped surrogate, averaged over the completion tokens."""
    logp = rollout_logprobs(params, cfg, batch["prompt_ids"], batch["prompt_lens"],
                            batch["tokens"], batch["lengths"], num_samples, remat=False)  # [R, T]
    keep = jnp.arange(logp.shape[1])[None, :] < batch["lengths"][:, None]
    ratio = jnp.exp(logp - batch["old_logprobs"])
    adv = batch["advantages"][:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    return -jnp.sum(jnp.where(keep, surrogate, 0.0)) / jnp.maximum(keep.sum(), 1)


def make_train_step(cfg, optimizer, num_samples: int, clip_eps: float):
    """jit((params, opt_state, batch) -> (params, opt_state, loss)), params and state donated
    (safe: the engine serves copies of its own, see LLM.update_weights)."""
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(policy_loss)(params, cfg, batch, num_samples, clip_eps)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Text prompts -> ([B, L] int32 ids, left-aligned, zero-padded; [B] lengths)."""
    rows = [tokenizer.encode(p) for p in prompts]
    lens = np.array([len(r) for r in rows], np.int32)
    ids = np.zeros((len(rows), 16 * -(-int(lens.max()) // 16)), np.int32)  # few widths
    for b, r in enumerate(rows):
        ids[b, :len(r)] = r
    return ids, lens


def score(tokenizer, task: str, out, answers: list[str], num_samples: int) -> np.ndarray:
    """[B * G] float32 rewards of the completions (decoded on the host)."""
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return np.array([rl_task.reward(task, tokenizer.decode(tokens[r, :lengths[r]].tolist()),
                                    answers[r // num_samples]) for r in range(len(lengths))],
                    np.float32)


def run_loop(model: str, rc: RLConfig, *, dtype: str = "float32", log=print, **engine_args):
    """Run `rc.steps` RL steps; returns one dict per step (reward, accuracy, loss, seconds of
    rollout / score / train / update)."""
    llm = LLM(model, dtype=dtype, seed=rc.seed, **engine_args)
    loaded = load_model(model, dtype="float32", seed=rc.seed)  # the trainer's fp32 masters
    params, cfg, tok = loaded.params, loaded.cfg, llm.get_tokenizer()
    optimizer = optax.adam(rc.lr)
    opt_state = optimizer.init(params)
    train_step = make_train_step(cfg, optimizer, rc.samples, rc.clip_eps)
    rng = np.random.default_rng(rc.seed)
    history = []
    for step in range(rc.steps):
        prompts, answers = rl_task.make_prompts(rc.task, rng, rc.prompts_per_step)
        ids, lens = encode_prompts(tok, prompts)
        t0 = time.perf_counter()
        # a seed per prompt (sample k of it: seed + k): no two rollouts share sampling noise
        base = (rc.seed * rc.steps + step) * rc.prompts_per_step * rc.samples
        sps = [SamplingParams(temperature=rc.temperature, max_tokens=rc.max_tokens,
                              n=rc.samples, seed=base + b * rc.samples) for b in range(len(ids))]
        out = jax.block_until_ready(llm.generate_arrays(ids, lens, sps))
        t1 = time.perf_counter()
        rewards = score(tok, rc.task, out, answers, rc.samples)
        batch = dict(prompt_ids=jnp.asarray(ids), prompt_lens=jnp.asarray(lens),
                     tokens=out.tokens, lengths=out.lengths, old_logprobs=out.logprobs,
                     advantages=jnp.asarray(grpo_advantages(rewards, rc.samples)))
        t2 = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, batch)
        loss = float(loss)  # waits for the step
        t3 = time.perf_counter()
        served = params if dtype == "float32" else jax.tree.map(
            lambda w: w.astype(dtype), params)
        llm.update_weights(served, donate=served is not params)
        t4 = time.perf_counter()
        row = dict(step=step, reward=float(rewards.mean()),
                   accuracy=float((rewards == 1.0).mean()), loss=loss,
                   rollout_s=t1 - t0, score_s=t2 - t1, train_s=t3 - t2, update_s=t4 - t3)
        history.append(row)
        log(f"step {step:3d}  reward {row['reward']:.3f}  accuracy {row['accuracy']:.3f}  "
            f"loss {loss:+.4f}  rollout {row['rollout_s']:.2f}s  score {row['score_s']:.2f}s  "
            f"train {row['train_s']:.2f}s  update {row['update_s']:.2f}s")
    return history
