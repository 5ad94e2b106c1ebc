#!/bin/bash
# Session 9 (helper s9-f64): the Qwen3.5 fixtures against the float64 truth, compiled on the H200 (~90 s).
# Run from the repository root with PYTHONPATH=$PWD; prints per prompt |ours - f64|, |ours - hf32|, |hf32 - f64|.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} MINIPIC_COMPILED=${MINIPIC_COMPILED:-1}
cat > $OUT/f64.py <<'PY'
import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "tests")
import test_qwen3_5 as T
from minipic_jax.models import testing
print(jax.devices())
rows = []
for name in T.QWEN_FIXTURES:
    lm, ref = T._model(name), T._ref(name)
    truth = np.load(T.FIXTURES / name / "reference_f64.npz")
    full = [np.concatenate([p, g[:-1]]) for p, g in zip(ref["prompt"], ref["greedy"])]
    b = np.cumsum([0] + [len(f) for f in full])
    for impl in ("xla", T.PALLAS_GDN):
        pager = testing.SimplePager(len(full), max(map(len, full)), 16)
        cache = lm.family.init_cache(lm.cfg, pager.num_pages, 16, len(full), jnp.float32)
        lg = T._step(lm, pager, cache, full, gdn_impl=impl)[0].astype(np.float64)
        for i in range(len(full)):
            g, h = lg[b[i]:b[i + 1]], ref["logits"][i]
            t = truth[f"logits_{i}"].astype(np.float64)
            rows.append((name, impl, i, len(full[i]), np.abs(g - t).max(),
                         np.linalg.norm(g - t) / np.linalg.norm(t), np.abs(g - h).max(),
                         np.abs(h - t).max()))
print("fixture impl prompt len |ours-f64| relL2(ours-f64) |ours-hf32| |hf32-f64|")
for r in rows:
    print("%s %s %d %d %.3e %.2e %.3e %.3e" % r)
PY
timeout 200 python3 -m pytest tests/test_qwen3_5.py -q -p no:cacheprovider --run-slow \
  -k "float64_truth or logits_and_greedy" > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"
timeout 200 python3 $OUT/f64.py 2>&1 | tee $OUT/f64.txt | tail -14
