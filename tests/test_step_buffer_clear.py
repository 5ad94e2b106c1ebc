"""A step's reused int buffer is cleared for the next step without zeroing its whole [S, NB]
block tables (1.6 MB at 64 seats and a 33K-token max_model_len, issue 28's cached-span step):
only the rows the buffer's last step wrote are zeroed, and those always are."""

from __future__ import annotations

import numpy as np

from benchmarks.engine_host import StubStep
from minipic_jax import SamplingParams
from serving.step.step_inputs import _SB_FIELDS
from tests.conftest import make_tiny_llm

SENTINEL = 77


def test_only_the_table_rows_a_buffer_last_wrote_are_zeroed():
    llm = make_tiny_llm(max_model_len=512, num_kv_blocks=160)
    runner = llm.llm_engine.runner
    runner._step = StubStep(llm.llm_engine.vocab_size)
    runner.dev_tables.set(False)  # the path whose steps carry [S, NB] rows (resident_tables.py)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([rng.integers(5, 200, 20).tolist() for _ in range(3)], sp, use_tqdm=False)
    ints, _, kw = runner.last_inputs  # a decode step of the three sequences
    key = next(k for k, (buf, _, _) in runner._bufs.items() if buf is ints)
    same_bucket = [runner._bufs[k] for k in runner._bufs if k[:2] == key[:2]]
    for _, _, v in same_bucket:  # rows 3.. no step wrote: a clear that touches them is seen
        for f in _SB_FIELDS:
            assert v[f].shape[0] > 3
            v[f][3:] = SENTINEL
    llm.generate([rng.integers(5, 200, 20).tolist()], sp, use_tqdm=False)
    ints2, _, kw2 = runner.last_inputs  # a decode step of one sequence, the same bucket
    assert (kw2["t"], kw2["s"]) == (kw["t"], kw["s"])
    for _, _, v in same_bucket:
        for f in _SB_FIELDS:
            assert (v[f][3:] == SENTINEL).all(), f"{f}: rows no step wrote were zeroed again"
    v2 = next(v for buf, _, v in same_bucket if buf is ints2)
    assert v2["block_tables"][0].any() and v2["block_num_valid"][0].any()
    for f in _SB_FIELDS:  # rows the three-sequence steps wrote are zero again
        assert not v2[f][1:3].any(), f
