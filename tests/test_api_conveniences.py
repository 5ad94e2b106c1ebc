"""vLLM conveniences (issue 15, item 7): stop strings, n > 1 parallel samples sharing the
prompt's blocks, `python -m minipic_jax`."""

from __future__ import annotations

import argparse
import runpy
import sys

import pytest

from conftest import make_tiny_llm
from minipic_jax import SamplingParams


@pytest.fixture(scope="module")
def llm():
    # one token bucket (min_token_bucket = max_num_batched_tokens = 64): no test here is about
    # bucket sizes, and each bucket compiled its own step variants (CI time)
    return make_tiny_llm(min_token_bucket=64)


class LetterTokenizer:
    """Every id is one letter (the tiny preset's bytes tokenizer prints nothing for most of the
    ids a random model samples)."""

    def decode(self, ids):
        return "".join(chr(65 + t % 26) for t in ids)


def test_stop_strings_cut_the_text(llm, fresh_rng, monkeypatch):
    tok = LetterTokenizer()
    monkeypatch.setattr(llm.llm_engine, "tokenizer", tok)
    prompt = [256] + [int(t) for t in fresh_rng.integers(0, 256, 20)]
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = base.text[4:6]  # two letters of the output text: the first match counts
    first = base.text.find(stop)
    ends = min(k for k in range(1, 13) if stop in tok.decode(base.token_ids[:k]))
    for include in (False, True):
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop, "\x00"],
                            include_stop_str_in_output=include)
        o = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert (o.finish_reason, o.stop_reason) == ("stop", stop)
        assert o.token_ids == base.token_ids[:ends]  # up to the token that completed it
        assert o.text == base.text[:first + (len(stop) if include else 0)]
    # min_tokens holds stop strings back like stop tokens
    late = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                 stop=stop, min_tokens=12), use_tqdm=False)[0]
    assert late.outputs[0].token_ids == base.token_ids  # every earlier match was held back
    # the 12th token is past min_tokens: only a match completed by that token's text stops
    before = tok.decode(base.token_ids[:11])
    last_match = stop in base.text[max(0, len(before) - len(stop) + 1):]
    assert late.outputs[0].finish_reason == ("stop" if last_match else "length")


def test_n_samples_share_prompt_blocks(llm, fresh_rng):
    prompt = [256] + [int(t) for t in fresh_rng.integers(0, 256, 70)]  # 4 full blocks + 7
    sp = SamplingParams(temperature=1.0, max_tokens=5, seed=11, n=3, ignore_eos=True)
    before = llm.llm_engine.get_stats()["computed_query_tokens"]
    out = llm.generate([prompt, [256, 1, 2]], [sp, SamplingParams(max_tokens=2)],
                       use_tqdm=False)
    computed = llm.llm_engine.get_stats()["computed_query_tokens"] - before
    assert [c.index for c in out[0].outputs] == [0, 1, 2] and len(out[1].outputs) == 1
    # the 64 tokens of the full blocks are computed once, not three times
    assert computed <= 71 + 2 * 7 + 3 * 4 + 3 + 1
    for k, comp in enumerate(out[0].outputs):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=5,
                                                      seed=11 + k, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert comp.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    with pytest.raises(ValueError, match="SamplingParams.n=3, but add_request runs one sample"):
        llm.llm_engine.add_request("x", prompt, sp)


def test_python_dash_m_runs_the_generate_cli(monkeypatch, capsys):
    """`python -m minipic_jax --help` lists the subcommands (it showed only generate's options,
    under the name minipic-generate); `SUBCOMMAND --help` shows each one's options."""
    monkeypatch.setattr(sys, "argv", ["minipic_jax", "--help"])
    with pytest.raises(SystemExit) as ex:
        runpy.run_module("minipic_jax", run_name="__main__")
    assert ex.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in ("generate", "run-batch", "train"))
    assert "minipic-train" in out and "minipic-bench" in out
    from minipic_jax.__main__ import main
    with pytest.raises(SystemExit) as ex:
        main(["generate", "--help"])
    assert ex.value.code == 0 and "minipic-generate" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["minipic_jax.batch.options", "minipic_jax.training.cli"])
def test_every_option_has_help(module):
    """run-batch --help and minipic-train --help: most options had no help text and no
    default."""
    import importlib
    parser = importlib.import_module(module).build_parser()
    text = parser.format_help()
    for action in parser._actions:
        assert action.help, action.option_strings
        if action.default is not None and action.default is not False \
                and action.default is not argparse.SUPPRESS:
            assert f"(default: {action.default})" in " ".join(text.split()), action.option_strings


def test_generate_hands_its_prompt_list_to_the_sequence(llm, monkeypatch):
    """A one-sample request's sequence keeps the id list generate built for it, uncopied (a
    33K-token prompt's copy is ~0.1 ms of its time to first token, issue 28); the samples of an
    n > 1 request each copy it (they append different tokens)."""
    import serving.llm_engine as engine_module
    kept = []

    class Spy(engine_module.Sequence):
        def __init__(self, request_id, prompt_token_ids, *args, **kwargs):
            super().__init__(request_id, prompt_token_ids, *args, **kwargs)
            kept.append(self.token_ids is prompt_token_ids)

    monkeypatch.setattr(engine_module, "Sequence", Spy)
    prompt = [256, 5, 6, 7, 8]
    one, two = llm.generate([prompt, prompt], [SamplingParams(max_tokens=2),
                                               SamplingParams(max_tokens=2, n=2)],
                            use_tqdm=False)
    assert kept == [True, False, False]
    assert one.prompt_token_ids == prompt and two.prompt_token_ids == prompt
    assert all(len(c.token_ids) == 2 for c in one.outputs + two.outputs)
