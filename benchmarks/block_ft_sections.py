"""The `sections` task of `minipic-bench block-ft`: facts whose meaning depends on a header in an
earlier document, so a full-attention model resolves them across documents.

An example is a few sections; each is two documents (two SSEP spans):
  a header "3$": the section's namespace (a digit, "3") and its tag (a symbol, "$");
  a table "$Ad": the tag again, then the fields (by default one, "A"), each with a value (one
      lowercase letter, random). Every table has the same fields.
The question "?3A" asks field A of namespace 3; the answer is its value in the table that follows
header 3 ("d"). The field alone is ambiguous (chance 1/sections).

With full attention a model can label every table token with its namespace while reading the
table: attend to the latest namespace digit, a cross-document look-back in one layer; the
question then matches (namespace, field) in one step. With Block-Attention a table sees only
itself, so that label is gone and the question must link the documents alone: find header 3, read
its tag, then find the table with that tag, two dependent look-ups. The information is all there
(the tag links the two documents), but a model trained with full attention does not do it (it
falls to about 1/sections, benchmarks/RESULTS.md "Training"); block fine-tuning has to teach it.
"""

from __future__ import annotations

import json

NAMESPACES = "0123456789"
TAGS = "!$%&*+<=>@^~"  # one byte-level token each, none a digit or letter
FIELDS = "ABCDEFGH"
VALUES = "abcdefghijklmnopqrstuvwxyz"


def add_arguments(p):
    p.add_argument("--sections", type=int, default=3,
                   help="sections: namespaces per question (default: %(default)s)")
    p.add_argument("--fields", type=int, default=1,
                   help="fields per table, the same in every section (default: %(default)s)")


def check(args):
    if not 2 <= args.sections <= min(len(NAMESPACES), len(TAGS)):
        raise ValueError(f"--sections must be in [2, {min(len(NAMESPACES), len(TAGS))}], got "
                         f"{args.sections}")
    if not 1 <= args.fields <= len(FIELDS):
        raise ValueError(f"--fields must be in [1, {len(FIELDS)}], got {args.fields}")
    if args.queries > args.sections * args.fields:
        raise ValueError(f"--queries {args.queries} > sections x fields")


def draw_section(rng, fields: int) -> tuple:
    """(namespace, tag, ((field, value), ...)): the fields in a random order."""
    order = rng.permutation(fields)
    return (NAMESPACES[rng.integers(len(NAMESPACES))], TAGS[rng.integers(len(TAGS))],
            tuple((FIELDS[i], VALUES[rng.integers(len(VALUES))]) for i in order))


def distinct(sections) -> bool:
    """No namespace and no tag occurs twice (so a question has one answer)."""
    return (len({s[0] for s in sections}) == len(sections)
            and len({s[1] for s in sections}) == len(sections))


def question(rng, sections, queries: int = 1) -> tuple[list, str]:
    """(segments, answer): a system prompt, header and table spans, the question.

    With queries > 1 (the training data) the answer goes on to ask and answer more (namespace,
    field) pairs ("d?7Ax?0Cq"), several supervised look-ups per example."""
    pairs = [(ns, k, v) for ns, _, table in sections for k, v in table]
    asked = [pairs[i] for i in rng.choice(len(pairs), queries, replace=False)]
    segs = [{"kind": "prompt", "text": "facts:"}]
    for ns, tag, table in sections:
        segs.append({"kind": "span", "text": ns + tag})
        segs.append({"kind": "span", "text": tag + "".join(k + v for k, v in table)})
    segs.append({"kind": "prompt", "text": f"?{asked[0][0]}{asked[0][1]}"})
    return segs, asked[0][2] + "".join(f"?{ns}{k}{v}" for ns, k, v in asked[1:])


def fresh_sections(rng, args) -> list:
    while not distinct(secs := [draw_section(rng, args.fields) for _ in range(args.sections)]):
        pass
    return secs


def write_train_data(path, args, rng, count: int, copy_fraction=0.0, copy_record=None):
    """`count` records: questions over freshly drawn sections; with copy_fraction > 0 (the
    pretraining file) that share of the records are copy_record(rng) instead."""
    with open(path, "w") as f:
        for _ in range(count):
            if rng.random() < copy_fraction:
                rec = copy_record(rng)
            else:
                segs, answer = question(rng, fresh_sections(rng, args), args.queries)
                rec = {"segments": segs, "answer": answer}
            f.write(json.dumps(rec) + "\n")


def eval_set(args, rng) -> list:
    """One-field questions over sections drawn from a pool of args.pool, so header and table
    spans repeat across questions (cache hits)."""
    pool = [draw_section(rng, args.fields) for _ in range(args.pool)]
    out = []
    while len(out) < args.eval:
        secs = [pool[i] for i in rng.choice(args.pool, args.sections, replace=False)]
        if distinct(secs):
            out.append(question(rng, secs))
    return out
