"""Fault injection: an exception raised at a random point inside a step (block allocation, a
page gather or copy-in, the jitted call, the read-back, applying its tokens) must leave the engine
consistent -- block ref counts zero, the free list whole, the hash table and host tier pointing at
real blocks -- and later requests must still match HF transformers (the fuzzer's oracle).

Each trial arms one hook to raise on its k-th call (hook and k drawn from the printed seed),
runs a batch of fuzz requests on the fuzzer's default configurations (async: a tiny pool with a
host tier of three blocks, so eviction, preemption and offload happen; sync: a large pool), and
checks the invariants whether or not the fault fired.
"""

from __future__ import annotations

import pytest

from test_fuzz_hf import DEFAULT, FUZZ, compare, config_id, make_llm, prompt_ids
from minipic_jax import SamplingParams

HOOKS = {  # name -> (object path on the engine, attribute)
    "allocate": ("bm", "allocate"),
    "share": ("bm", "share"),
    "share_many": ("bm", "share_many"),
    "gather": ("mover", "gather"),
    "copy_in": ("mover", "scatter"),
    "host_get": ("offload", "get"),
    "launch": ("runner", "launch"),
    "read_back": ("runner", "fetch"),
    "apply_tokens": (None, "_postprocess"),
}
CASES = FUZZ["cases"][:3]


class Fault(RuntimeError):
    pass


def arm(engine, hook: str, k: int):
    """Make the hook raise Fault on its k-th call from now; returns a disarm function."""
    path, attr = HOOKS[hook]
    obj = engine if path is None else getattr(engine, path)
    real, calls = getattr(obj, attr), [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            raise Fault(f"injected into {hook} at call {k}")
        return real(*args, **kwargs)

    setattr(obj, attr, faulty)
    return lambda: setattr(obj, attr, real)


def assert_consistent(engine):
    bm = engine.bm
    assert not engine.has_unfinished() and not engine._seqs
    assert not any(bm.ref), [b for b, r in enumerate(bm.ref) if r]
    assert sorted(bm.free) == list(range(bm.num_blocks)), "free list is not every block once"
    for h, b in bm.table.items():
        assert bm.hash[b] == h and bm.ready[b] and bm.owner[b] == -1
    assert sum(h != -1 for h in bm.hash) == len(bm.table)
    assert engine.num_in_flight == 0 and not engine.cache.pending_copy_in
    if engine.offload is not None:
        assert len(engine.offload.entries) <= engine.offload.capacity


def run_batch(llm, sp):
    reqs = [r for case in CASES for r in case["turns"][0]]
    outs = llm.generate([prompt_ids(r, llm.config.block_size) for r in reqs], sp, use_tqdm=False)
    return sum(compare(r, o, f"request {i}") for i, (r, o) in enumerate(zip(reqs, outs)))


@pytest.mark.parametrize("c", DEFAULT, ids=config_id)
def test_faults_inside_a_step_leave_the_engine_consistent(c, fresh_rng):
    llm = make_llm(c, CASES)  # the fuzzer's default configurations: their compiles are cached
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=FUZZ["max_new"], ignore_eos=True,
                        logprobs=FUZZ["top"])
    hooks = [h for h, (path, _) in HOOKS.items()  # no host-tier hooks without a host tier
             if path is None or getattr(engine, path, None) is not None]
    fired = set()
    for trial in range(6):
        if trial < 2:  # these two fire in every configuration
            hook, k = ("allocate", "launch")[trial], int(fresh_rng.integers(1, 4))
        else:
            hook, k = hooks[int(fresh_rng.integers(len(hooks)))], int(fresh_rng.integers(1, 40))
        disarm = arm(engine, hook, k)
        try:
            run_batch(llm, sp)
        except Fault:
            fired.add(hook)
        finally:
            disarm()
        print(f"trial {trial}: {hook} at call {k}: {'fired' if hook in fired else 'not reached'}")
        assert_consistent(engine)
        assert run_batch(llm, sp) > 0  # later requests match HF
        assert_consistent(engine)
    assert {"allocate", "launch"} <= fired
