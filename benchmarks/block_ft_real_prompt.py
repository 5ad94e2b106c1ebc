"""The chat prompt of the real-model block fine-tuning task, as segments (one place, so it can
switch to `LLM.chat` once chat templates are in the engine).

The segments follow the ChatML template SmolLM2-Instruct ships (tokenizer chat_template): the
system turn, then one user turn that holds the instruction, the passages and the question, then
the assistant header. As segments:

    Prompt("<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n" + instruction)
    Span(passage 1 + "\\n\\n") ... Span(passage n + "\\n\\n")
    Prompt("Question: ...<|im_end|>\\n<|im_start|>assistant\\n")

The same segments are minipic-train's records (with "answer") and the engine's prompts: as
Prompt/Span for Block-Attention, joined as one plain prompt for full attention (each segment
tokenized alone in both, so the two see the same tokens apart from markers and pads).
"""

from __future__ import annotations

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the default turn
INSTRUCTION = ("Answer the question using the passages below. Reply with the answer only: a name, "
               "a year or a place.\n\n")


def chat_segments(passages, question: str, *, system: str = SYSTEM,
                  instruction: str = INSTRUCTION) -> list[dict]:
    """minipic-train segments ({"kind", "text"}) of one question over its passages."""
    head = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{instruction}")
    segs = [{"kind": "prompt", "text": head}]
    segs += [{"kind": "span", "text": f"{p}\n\n"} for p in passages]
    segs.append({"kind": "prompt", "text": f"Question: {question}<|im_end|>\n"
                                           f"<|im_start|>assistant\n"})
    return segs


def training_record(passages, question: str, answer: str) -> dict:
    """A minipic-train record. The answer is the text alone: minipic-train appends the model's
    EOS (<|im_end|> for SmolLM2-Instruct, its config's eos_token_id) after it."""
    return {"segments": chat_segments(passages, question), "answer": answer}
