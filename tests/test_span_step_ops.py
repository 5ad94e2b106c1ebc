"""A hybrid span step's GDN layer runs, outside the kernels, about what a plain step's does plus
the span rows' own data movement (issue 19: on a GPU each small op is a launch, and 18 GDN layers
repeat them). Everything that depends on the step's metadata alone (the local pass's packings,
conv windows, final-state and carry indices; the flow prefill's packing) is computed once per
step (qwen3_5_spans.prepare, qwen3_5._gdn_step_inputs). Counted on the traced step at the
bench's widths (qwen3_5_0_8b; equations outside Pallas kernel bodies, tests/jaxpr_walk.py; the
counts do not depend on T or S): one GDN layer is the difference between 2 and 1 GDN layers.
Bounds are ratios to the plain step's layer (they were 2.01x and 2.78x when every layer redid
the index work; 1.39x and 1.69x after, the plain layer's own index work, conv windows and flow
packing, hoisted too: 482 -> 224 equations)."""

import pytest

from benchmarks.span_step_ops import per_layer

T, S = 512, 8


@pytest.fixture(scope="module")
def plain():
    return per_layer("plain", T, S)["per_gdn_layer"]["jaxpr"]


@pytest.mark.parametrize("kind, bound", [("span", 1.5), ("capture", 1.8)])
def test_span_layer_ops_stay_near_the_plain_layer(plain, kind, bound):
    ops = per_layer(kind, T, S)["per_gdn_layer"]["jaxpr"]
    assert ops <= bound * plain, (kind, ops, plain, ops / plain)

