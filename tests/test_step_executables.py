"""Stored step executables (serving/step/executable_store.py): a second engine of the same
configuration loads every warm-up variant instead of tracing it, and generates exactly what the
cold engine did (tokens and logprobs, bit for bit); a changed configuration or changed source
misses; a damaged file is a miss, never an error."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_tiny_llm
from minipic_jax import SamplingParams
from serving.step import executable_store

SMALL = dict(max_num_batched_tokens=16, min_token_bucket=16, max_model_len=128)
PROMPTS = [[256, 72, 101, 108, 108, 111], [256] + list(range(40, 75))]  # one fits, one chunks
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
          SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=6, logprobs=2)]


@pytest.fixture
def store(tmp_path):
    return tmp_path


def _start(store, **overrides):
    llm = make_tiny_llm(**{**SMALL, "step_cache": str(store), **overrides})
    llm.llm_engine.warmup()
    return llm, dict(llm.llm_engine.runner._step.counts)


def _generate(llm):
    out = []
    for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False):
        c = o.outputs[0]
        out.append((list(c.token_ids), [sorted(d.items()) for d in c.logprobs]))
    return out


def test_second_start_loads_every_variant_and_matches_the_cold_start(store):
    cold, counts = _start(store)
    assert counts["loaded"] == 0 and counts["compiled"] >= 1
    expected = _generate(cold)  # also compiles (and stores) the logprobs variants lazily
    stored = len(list(store.glob("*.exe")))
    assert stored == cold.llm_engine.runner._step.counts["compiled"]
    warm, counts = _start(store)
    assert counts == {"loaded": counts["loaded"], "compiled": 0} and counts["loaded"] >= 1
    runner = warm.llm_engine.runner
    assert runner._step.jitted._cache_size() == 0  # nothing traced
    assert _generate(warm) == expected
    assert runner._step.counts["compiled"] == 0  # the run's variants came from the store too
    assert runner.startup["trace_s"] == 0.0 and runner.startup["loaded"] == counts["loaded"]


def test_changed_key_or_damaged_file_misses(store, monkeypatch):
    _, counts = _start(store)
    assert counts["loaded"] == 0
    _, counts = _start(store, max_model_len=256)  # another block-table width: other programs
    assert counts["loaded"] == 0
    with monkeypatch.context() as m:  # the step's source changed: nothing stored is used
        m.setattr(executable_store, "source_digest", lambda dirs=(): "changed")
        _, counts = _start(store)
        assert counts["loaded"] == 0
    for path in store.glob("*.exe"):
        path.write_bytes(b"not an executable")
    with pytest.warns(RuntimeWarning, match="could not be loaded"):
        _, counts = _start(store)
    assert counts["loaded"] == 0 and counts["compiled"] >= 1


def test_store_folder_follows_the_documented_settings(monkeypatch, tmp_path):
    import jax
    assert executable_store.store_folder("off") is None
    assert executable_store.store_folder(str(tmp_path)) == tmp_path
    base = jax.config.jax_compilation_cache_dir
    assert executable_store.store_folder("on") == (None if not base else
                                                   __import__("pathlib").Path(base) / "minipic_steps")
    monkeypatch.setattr(executable_store, "DEFAULT_SETTING", "off")  # the suite's (conftest)
    assert executable_store.store_folder(None) is None
    monkeypatch.setattr(executable_store, "DEFAULT_SETTING", "on")
    assert executable_store.store_folder(None) == executable_store.store_folder("on")


def test_the_step_cache_environment_variable_is_no_longer_read(monkeypatch, tmp_path):
    """Config.step_cache replaced $MINIPIC_STEP_CACHE: setting the variable changes nothing."""
    monkeypatch.setenv("MINIPIC_STEP_CACHE", str(tmp_path))
    assert executable_store.store_folder("off") is None
    monkeypatch.setattr(executable_store, "DEFAULT_SETTING", "off")
    assert executable_store.store_folder(None) is None


def test_a_variant_compiles_while_the_next_is_traced(monkeypatch):
    """prepare hands each lowered variant to a compile thread before tracing the next (XLA
    compiles off the GIL while Python lowers: the warm-up's compile no longer waits for every
    lowering). The second variant's trace waits (at most 10 s) for the first compile to start."""
    import threading

    import jax
    import jax.numpy as jnp

    from serving.step.step_executables import StepExecutables

    started, seen = threading.Event(), []
    compile_ = jax.stages.Lowered.compile

    def compile_spy(self, *args, **kwargs):
        started.set()
        return compile_(self, *args, **kwargs)
    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_spy)

    def fun(x, *, scale=2):
        if scale == 3:  # traced second
            seen.append(started.wait(10))
        return x * scale
    steps = StepExecutables(fun, signature_of=fun, donate_argnums=())
    steps.prepare([((jnp.ones(3),), {"scale": 2}), ((jnp.ones(3),), {"scale": 3})])
    assert seen == [True]
    assert steps.counts["compiled"] == 2
    np.testing.assert_array_equal(steps(jnp.ones(3), scale=3), np.full(3, 3.0))
