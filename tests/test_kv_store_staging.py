"""Device memory of the span store's reads (serving/tiers/kv_store_staging.py, kv_store_tier.py) and of
its benchmark's orchestrator (benchmarks/kv_store_bench.py).

On the H200 (session 9) the warm phases ran out of device memory: the bench's orchestrator held
75% of the GPU (its `--io` pass sent runs to the device), and each staged run held its whole
padded array on the device, while the staging limit counted blocks. Oracles: the bytes of the
arrays alive (`jax.live_arrays`) over a warm job, against the limit the user set; a cold run's
tokens; `jax` absent from the orchestrator's modules.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import make_tiny_llm
from minipic_jax import Prompt, SamplingParams, Span, build_prompt
from serving.tiers.kv_store_staging import StagedBlocks, run_nbytes
from serving.tiers.run_file import Run, run_rows

SP = SamplingParams(temperature=0.0, max_tokens=2)
B = 16
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(rows: int) -> Run:
    return Run(np.zeros(rows, np.uint64), None, np.zeros((2, rows, B, 4), np.float32))


def test_staged_bytes_are_whole_runs_until_their_last_block_leaves():
    a, b = _run(16), _run(32)
    st = StagedBlocks()
    st.put(1, a, 0)
    st.put(2, a, 1)
    st.put(3, b, 0)
    assert st.nbytes == run_nbytes(a) + run_nbytes(b) == 3 * 16 * 2 * B * 4 * 4
    st.pop(1)
    assert st.nbytes == run_nbytes(a) + run_nbytes(b)  # row 1 still pins run a
    st.put(3, a, 2)  # block 3 staged again from run a: run b is no longer held
    assert st.nbytes == run_nbytes(a) and 3 in st and len(st) == 2
    assert st.drop_oldest_run() == run_nbytes(a) and st.nbytes == 0 and len(st) == 0


def _live_bytes() -> int:
    """Bytes of the arrays alive, each buffer once (on CPU a transfer of a numpy array may alias
    it, and a second array object over the same buffer appears once it is waited for)."""
    seen = {}
    for x in jax.live_arrays():
        seen[x.unsafe_buffer_pointer()] = x.nbytes
    return sum(seen.values())


def test_warm_job_keeps_staged_device_bytes_under_the_limit(tmp_path, fresh_rng):
    """A warm job whose store holds ~6x the staging limit: at every step the arrays alive
    beyond the engine's own stay under the limit plus one request's runs (the request a step
    admits without waiting reads at admission), all span blocks still hit, and the tokens are
    the cold run's."""
    shape = dict(kv_store_dir=str(tmp_path), max_num_seqs=8, max_num_batched_tokens=256,
                 min_token_bucket=256, num_kv_blocks=256, max_model_len=512)
    writer = make_tiny_llm(**shape)
    docs = [[int(t) for t in fresh_rng.integers(0, 256, int(fresh_rng.integers(33, 90)))]
            for _ in range(16)]
    mk = writer.llm_engine.markers
    prompts = [build_prompt([Prompt([int(t) for t in fresh_rng.integers(0, 256, 4)]),
                             Span(docs[2 * i]), Span(docs[2 * i + 1]), Prompt([7, 8, 9])],
                            block_size=B, **mk) for i in range(8)]
    cold = writer.generate(prompts, SP, use_tqdm=False)
    run = run_rows(1) * writer.llm_engine.bytes_per_block  # each span is one run of <= 16 rows
    limit, one_request = 4 * run, 4 * run  # prompt, span, span, prompt: at most 4 runs
    reader = make_tiny_llm(kv_store_staging_gb=limit / (1 << 30), **shape)
    eng = reader.llm_engine
    base = _live_bytes()
    for k, p in enumerate(prompts):
        eng.add_request(str(k), p, SP)
    outs, worst = [], 0
    while eng.has_unfinished():
        outs += eng.step()
        worst = max(worst, _live_bytes() - base)
    kv = eng.get_stats()["kv_store"]
    print(f"limit {limit}, peak staged {kv['peak_staging_bytes']}, live beyond the engine "
          f"{worst}, runs read {kv['runs_read']} of {run} bytes")
    assert kv["peak_staging_bytes"] <= limit + one_request, kv
    assert kv["runs_read"] * run >= 4 * limit, kv  # the limit was binding
    assert worst <= kv["peak_staging_bytes"] + (64 << 10), worst  # 64 KiB: step in/outputs
    outs.sort(key=lambda o: int(o.request_id))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cold]
    assert all(o.num_cached_tokens >= 2 * 3 * B for o in outs)  # both spans (>= 3 blocks)


def test_bench_orchestrator_stays_off_the_device(tmp_path):
    """`kv_store_bench --io` times the file layer in a child process; the orchestrator (whose
    phases are stubbed here) never imports jax, so no phase shares the GPU with it."""
    code = ("import sys, benchmarks.kv_store_bench as b\n"
            "b._run = lambda *a, **k: None\n"
            f"b.main(['--out', {str(tmp_path)!r}, '--samples', '1', '--phases', 'cold,warm_s2',"
            " '--io', '--io-runs', '2', '--io-blocks', '2'])\n"
            "assert 'jax' not in sys.modules, 'the orchestrator imported jax'\n"
            "print('io', b.json.load(open(sys.argv[1]))['io_bench']['runs'])\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "kv_store_bench.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "io 2" in p.stdout, p.stdout[-2000:]


def test_default_pool_leaves_the_staging_memory_free(monkeypatch, tmp_path):
    """num_kv_blocks=None with a span store: the pool is what gpu_memory_utilization leaves
    after kv_store_staging_gb (the staged runs live next to it on the device)."""
    from serving.cache import kv_pool
    from serving.config import Config
    from configs.presets import get_preset

    class _Device:
        def memory_stats(self):
            return {"bytes_limit": 8 << 30, "bytes_in_use": 0}
    mcfg = get_preset("tiny_llama")
    per_block = 2 * mcfg.num_kv_layers * mcfg.num_kv_heads * mcfg.head_dim * 2 * B  # bf16
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_Device()])
    cfg = Config.from_flat(max_num_seqs=2, max_model_len=256, block_size=B,
                           gpu_memory_utilization=0.5, kv_store_dir=str(tmp_path),
                           kv_store_staging_gb=1.5)
    import ml_dtypes
    assert kv_pool.default_num_blocks(cfg, mcfg, ml_dtypes.bfloat16) == \
        int((4 << 30) - 1.5 * (1 << 30)) // per_block


def test_staging_default_follows_the_device_and_an_explicit_value_wins(monkeypatch):
    """kv_store_staging_gb=None: min(16 GiB, 16% of the device's limit), 4 GiB without memory
    stats; an explicit value is taken as is; <= 0 is refused, naming the option."""
    from serving.cache import kv_pool
    from serving.config import Config
    assert kv_pool.staging_bytes(Config.from_flat(kv_store_staging_gb=1.5)) == int(1.5 * (1 << 30))
    monkeypatch.setattr(kv_pool, "device_memory", lambda: {})
    assert kv_pool.staging_bytes(Config()) == 4 << 30
    monkeypatch.setattr(kv_pool, "device_memory", lambda: {"bytes_limit": 40 << 30})
    assert kv_pool.staging_bytes(Config()) == int(0.16 * (40 << 30))
    monkeypatch.setattr(kv_pool, "device_memory", lambda: {"bytes_limit": 200 << 30})
    assert kv_pool.staging_bytes(Config()) == 16 << 30
    with pytest.raises(ValueError, match="kv_store_staging_gb"):
        Config.from_flat(kv_store_staging_gb=0)
