"""The RAG task of `minipic-bench block-ft --model <real model>`: natural-language passages about
fictional entities, one of which answers the question.

A question's passages are all of one kind (towns, people or ships), each about a different
entity; one is about the entity asked for, the others are distractors whose attributes differ
from the answer. Every value is drawn from the seed, so nothing is known without reading:

    The town of Olvane lies on the river Brisk, in a valley of orchards and stone bridges. It was
    founded in 1642 by the weaver Tamsin Ardell, and today it is known for its blue wool. ...
    Question: In which year was the town of Olvane founded?      Answer: 1642

Entity names are built from syllables; the candidate names are shuffled by the seed and split
into a training and a held-out part, so no held-out entity (nor any name that could be an
answer) occurs in training. Training questions draw fresh attributes for every record (the facts
must be read, never memorised); the held-out questions share one fixed world of entities, so
their passages repeat across questions and the span run reuses them from the cache.

Scoring: the greedy answer contains the gold answer (case-insensitive); a person's gold answer is
the family name. The instruction asks for the answer alone, but SmolLM2-135M-Instruct replies in
a sentence that repeats the question ("The town of Hultur lies on the river Loces."), so the
recipe's default --max-tokens is 24, room for such a sentence.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s",
           "t", "th", "v", "w")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
_CODAS = ("", "n", "r", "l", "s", "th", "nd", "rk", "ne", "sk", "ll", "m")
TRADES = ("weaver", "miller", "smith", "potter", "carpenter", "merchant", "fisher", "brewer",
          "mason", "tanner", "baker", "glassblower")
GOODS = ("blue wool", "salted fish", "copper pots", "apple cider", "river pearls", "honey cakes",
         "painted tiles", "silver bells", "oak barrels", "goat cheese", "linen sails", "clocks")
FEATURES = ("orchards and stone bridges", "pine forests and quiet lakes", "vineyards and windmills",
            "marshes and reed beds", "cliffs and narrow harbours", "wheat fields and chalk hills")
DEEDS = ("mapping the northern coast", "a treatise on tides", "building the first paper mill",
         "a long poem about the sea", "charting the winter stars", "a famous bridge of red stone",
         "founding a school for sailors", "the great flood survey")
CARGO = ("spices", "timber", "salt", "wine", "wool", "furs", "tea", "iron ore")

KINDS = ("town", "person", "ship")


def _name(syllables) -> str:
    return "".join(syllables).capitalize()


def _candidate_names() -> list[str]:
    """Two-syllable names ("Tamsin", "Olvane"): a light first syllable, a fixed sorted list."""
    first = [o + v + c for o, v, c in itertools.product(_ONSETS, _VOWELS[:5], ("", "n", "r", "l",
                                                                                "s", "m"))]
    second = [o + v + c for o, v, c in itertools.product(_ONSETS, _VOWELS, _CODAS)]
    return sorted({_name(p) for p in itertools.product(first[::3], second[::13])})


@dataclasses.dataclass(frozen=True)
class NamePool:
    """The names one split may use: places (towns, rivers, ships) and people (given, family)."""
    places: tuple[str, ...]
    given: tuple[str, ...]
    family: tuple[str, ...]

    def person(self, rng) -> str:
        return f"{self.given[rng.integers(len(self.given))]} {self.family[rng.integers(len(self.family))]}"


def name_pools(seed: int, held_out_share: float = 0.25) -> tuple[NamePool, NamePool]:
    """(train, held-out) name pools: disjoint, a deterministic function of the seed."""
    names = np.random.default_rng([seed, 17]).permutation(_candidate_names()).tolist()
    places, given, family = names[0::3], names[1::3], names[2::3]
    cut = lambda xs: int(len(xs) * (1 - held_out_share))
    train = NamePool(*(tuple(xs[:cut(xs)]) for xs in (places, given, family)))
    held = NamePool(*(tuple(xs[cut(xs):]) for xs in (places, given, family)))
    return train, held


def _pick(rng, xs):
    return xs[rng.integers(len(xs))]


def draw_entity(kind: str, rng, pool: NamePool, name: str) -> dict:
    """An entity's attributes (a dict of strings), its name given."""
    year = str(int(rng.integers(1420, 1900)))
    if kind == "town":
        return dict(kind=kind, name=name, river=_pick(rng, pool.places), year=year,
                    founder=pool.person(rng), trade=_pick(rng, TRADES), goods=_pick(rng, GOODS),
                    feature=_pick(rng, FEATURES))
    if kind == "person":
        return dict(kind=kind, name=name, town=_pick(rng, pool.places), year=year,
                    trade=_pick(rng, TRADES), deed=_pick(rng, DEEDS), teacher=pool.person(rng))
    return dict(kind=kind, name=name, town=_pick(rng, pool.places), year=year,
                owner=pool.person(rng), cargo=_pick(rng, CARGO), port=_pick(rng, pool.places))


def passage(e: dict) -> str:
    """The entity as a short paragraph (about 45-65 tokens)."""
    if e["kind"] == "town":
        return (f"The town of {e['name']} lies on the river {e['river']}, in a valley of "
                f"{e['feature']}. It was founded in {e['year']} by the {e['trade']} "
                f"{e['founder']}, and today it is known for its {e['goods']}.")
    if e["kind"] == "person":
        return (f"{e['name']} was a {e['trade']} born in the town of {e['town']} in {e['year']}. "
                f"A pupil of {e['teacher']}, {e['name'].split()[0]} is best remembered for "
                f"{e['deed']}.")
    return (f"The ship {e['name']} was built in {e['town']} in {e['year']} for the merchant "
            f"{e['owner']}. For many years it carried {e['cargo']} to the port of {e['port']}.")


# per kind: (question, attribute that answers it)
QUESTIONS = {
    "town": (("In which year was the town of {name} founded?", "year"),
             ("Who founded the town of {name}?", "founder"),
             ("On which river does the town of {name} lie?", "river")),
    "person": (("In which town was {name} born?", "town"),
               ("In which year was {name} born?", "year"),
               ("Whose pupil was {name}?", "teacher")),
    "ship": (("In which town was the ship {name} built?", "town"),
             ("For which merchant was the ship {name} built?", "owner"),
             ("To which port did the ship {name} carry its cargo?", "port")),
}


PERSON_ATTRS = ("founder", "teacher", "owner")


@dataclasses.dataclass(frozen=True)
class Question:
    passages: tuple[str, ...]  # in prompt order; one of them answers
    question: str
    answer: str
    gold_index: int  # which passage answers


def _distinct_answers(entities, attr) -> bool:
    """No passage's value for `attr` contains another's (the scoring is by containment)."""
    vals = [e[attr].lower() for e in entities]
    return all(a == b or (a not in b and b not in a) for a, b in itertools.product(vals, vals)) \
        and len(set(vals)) == len(vals)


def gold(entity: dict, attr: str) -> str:
    """The answer to score: a person's family name (the given name is optional in a reply)."""
    value = entity[attr]
    return value.split()[-1] if attr in PERSON_ATTRS else value


def make_question(rng, entities: list[dict]) -> Question | None:
    """A question about entities[0] with the others as distractors, shuffled; None when the
    answer would be ambiguous (a distractor's passage contains it too)."""
    text, attr = _pick(rng, QUESTIONS[entities[0]["kind"]])
    answer = gold(entities[0], attr)
    if not _distinct_answers(entities, attr) or any(
            correct(passage(e), answer) for e in entities[1:]):
        return None
    order = rng.permutation(len(entities))
    return Question(tuple(passage(entities[i]) for i in order), text.format(name=entities[0]["name"]),
                    answer, int(np.flatnonzero(order == 0)[0]))


def _names(rng, kind, pool: NamePool, n: int) -> list[str]:
    if kind == "person":
        out: list[str] = []
        while len(out) < n:
            if (p := pool.person(rng)) not in out:
                out.append(p)
        return out
    return [pool.places[i] for i in rng.choice(len(pool.places), n, replace=False)]


def train_questions(seed: int, count: int, passages: int = 4) -> list[Question]:
    """`count` training questions over training names, every record with fresh attributes."""
    pool = name_pools(seed)[0]
    rng = np.random.default_rng([seed, 1])
    out = []
    while len(out) < count:
        kind = _pick(rng, KINDS)
        ents = [draw_entity(kind, rng, pool, n) for n in _names(rng, kind, pool, passages)]
        if (q := make_question(rng, ents)) is not None:
            out.append(q)
    return out


def held_out_questions(seed: int, count: int, passages: int = 4,
                       entities_per_kind: int = 24) -> list[Question]:
    """`count` questions over one fixed world of held-out entities (so passages repeat)."""
    pool = name_pools(seed)[1]
    rng = np.random.default_rng([seed, 2])
    world = {k: [draw_entity(k, rng, pool, n) for n in _names(rng, k, pool, entities_per_kind)]
             for k in KINDS}
    out = []
    while len(out) < count:
        ents = world[_pick(rng, KINDS)]
        chosen = [ents[i] for i in rng.choice(len(ents), passages, replace=False)]
        if (q := make_question(rng, chosen)) is not None:
            out.append(q)
    return out


def correct(output: str, answer: str) -> bool:
    """The task's score: the answer text contains the gold answer (case-insensitive)."""
    return answer.lower() in output.lower()
