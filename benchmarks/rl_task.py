"""Verifiable tasks for the RL demo (`minipic-bench rl`): prompts with a known answer and a
checker, as text, so any model with a tokenizer can take them (a byte-level preset or a real one).

  next_letter: "cfaj" -> "a"  (the letter after the last one, a-j cyclic: a tiny random model
               learns it within a few dozen steps, the answer depends on the last token only)
  last_letter: "cfaj>" -> "j" (copy the letter before ">": needs attention, learnt slowly)
  add:         "3+4=" -> "7"  (one-digit sums: for a real instruct model)

Reward: 1 for a completion that starts with the answer, 0.1 for one that at least starts with a
character of the answer's alphabet (letters a-j / digits), else 0.
"""

from __future__ import annotations

import numpy as np

LETTERS = "abcdefghij"
DIGITS = "0123456789"
TASKS = ("next_letter", "last_letter", "add")


def make_prompts(task: str, rng: np.random.Generator, count: int) -> tuple[list, list]:
    """`count` (prompt text, answer text) pairs of `task`."""
    prompts, answers = [], []
    for _ in range(count):
        if task == "next_letter":
            s = "".join(rng.choice(list(LETTERS), size=int(rng.integers(3, 7))))
            prompts.append(s)
            answers.append(LETTERS[(LETTERS.index(s[-1]) + 1) % len(LETTERS)])
        elif task == "last_letter":
            s = "".join(rng.choice(list(LETTERS), size=int(rng.integers(3, 7))))
            prompts.append(s + ">")
            answers.append(s[-1])
        elif task == "add":
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            prompts.append(f"{a}+{b}=")
            answers.append(str(a + b))
        else:
            raise ValueError(f"unknown task {task!r}; one of {TASKS}")
    return prompts, answers


def reward(task: str, completion: str, answer: str) -> float:
    """The checker: 1 (correct), 0.1 (right format), 0."""
    text = completion.lstrip(" ")
    if text.startswith(answer) and (len(text) == len(answer) or not text[len(answer)].isdigit()):
        return 1.0
    alphabet = DIGITS if task == "add" else LETTERS
    return 0.1 if text[:1] and text[0] in alphabet else 0.0
