"""RULER-style retrieval tasks, generated locally and seeded: quality gates that can fail.

Each :class:`Task` is a document (filler text with one or more planted needles), a question asked
after it, and a scorer of the model's answer. The document becomes the reusable context
(:func:`sparkv.edge.prompts.chat_context`) and the question its suffix, exactly as the edge asks.

* ``passkey``: a 5-digit pass key at a given depth of "The grass is green. The sky is blue. ..."
  filler (the RULER / LongLLaMA pass-key task). Correct when the key appears in the answer.
* ``multikey``: several "special magic numbers" for different words, one asked (RULER's
  niah_multikey). Correct when the asked word's number appears and no other planted one does.
* ``multivalue``: one word with several numbers, all asked (RULER's niah_multivalue). Scored by
  the fraction of its numbers in the answer; correct when all are there.

SmolLM2-135M-Instruct with full dense KV retrieves the pass key at 1K-8K tokens and depths 10-90%
(../shared/notes/measured-here.md); how it does on the harder two is measured, not assumed
(``sparkv bench quality``, :mod:`sparkv.bench.quality`, reports dense first and judges every other
configuration only on the tasks dense answers: a task dense fails says nothing).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
PREAMBLE = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the important information there.\n\n")
WORDS = ("apple", "river", "candle", "falcon", "marble", "violet", "harbor", "pepper", "silver",
         "meadow", "thunder", "lantern", "copper", "walnut", "orchid", "glacier")


@dataclass
class Task:
    """One generated retrieval task.

    Attributes:
        kind: ``passkey``, ``multikey`` or ``multivalue``.
        document: the context text (filler with the needles).
        question: asked after the document.
        answers: what the answer must contain (numbers as strings).
        distractors: planted values that must not be given (``multikey``).
        depth: where the (first) needle sits, 0..1 of the document.
        tokens: the document's token count (after :func:`make_task` fitted it).
        seed: the generator's seed.
    """

    kind: str
    document: str
    question: str
    answers: list[str]
    distractors: list[str] = field(default_factory=list)
    depth: float = 0.5
    tokens: int = 0
    seed: int = 0

    def score(self, answer: str) -> float:
        """Fraction of the expected numbers found (0 if a distractor is given instead)."""
        found = set(re.findall(r"\d+", answer))
        if any(d in found for d in self.distractors) and not all(a in found for a in self.answers):
            return 0.0
        return sum(a in found for a in self.answers) / len(self.answers)

    def correct(self, answer: str) -> bool:
        return self.score(answer) >= 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "question": self.question, "answers": self.answers,
                "distractors": self.distractors, "depth": self.depth, "tokens": self.tokens,
                "seed": self.seed}


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _plant(needles: list[tuple[float, str]], filler_sentences: int) -> str:
    """Filler with each needle inserted at its depth (fraction of the filler sentences)."""
    sentences = [FILLER] * filler_sentences
    for depth, text in sorted(needles, key=lambda x: -x[0]):
        at = int(round(depth * filler_sentences))
        sentences.insert(at, text)
    return PREAMBLE + "".join(sentences)


def _needles(kind: str, rng: random.Random, depth: float
             ) -> tuple[list[tuple[float, str]], str, list[str], list[str]]:
    if kind == "passkey":
        key = _number(rng, 5)
        return ([(depth, f"The pass key is {key}. Remember it. {key} is the pass key. ")],
                "What is the pass key? Answer with the number only.", [key], [])
    if kind == "multikey":
        words = rng.sample(WORDS, 4)
        values = [_number(rng, 7) for _ in words]
        depths = [depth] + [rng.random() for _ in words[1:]]
        needles = [(d, f"One of the special magic numbers for {w} is: {v}. ")
                   for d, w, v in zip(depths, words, values)]
        return (needles, f"What is the special magic number for {words[0]} mentioned in the "
                         "provided text? Answer with the number only.", [values[0]], values[1:])
    if kind == "multivalue":
        word = rng.choice(WORDS)
        values = [_number(rng, 7) for _ in range(3)]
        depths = [depth] + [rng.random() for _ in values[1:]]
        needles = [(d, f"One of the special magic numbers for {word} is: {v}. ")
                   for d, v in zip(depths, values)]
        return (needles, f"What are all the special magic numbers for {word} mentioned in the "
                         "provided text? List the numbers only.", values, [])
    raise ValueError(f"unknown task kind {kind!r}; known: passkey, multikey, multivalue")


def make_task(kind: str, num_tokens: int, depth: float, seed: int,
              count_tokens: Callable[[str], int]) -> Task:
    """A ``kind`` task whose document is ``num_tokens`` tokens (within a filler sentence) with
    its (first) needle at ``depth``. ``count_tokens`` is the model's tokenizer."""
    rng = random.Random(f"{kind}:{num_tokens}:{depth}:{seed}")
    needles, question, answers, distractors = _needles(kind, rng, depth)
    per = max(1, count_tokens(FILLER * 8) // 8)
    n = max(1, num_tokens // per)
    doc = _plant(needles, n)
    # fit: drop or add filler sentences until the document is just under num_tokens
    for _ in range(64):
        tokens = count_tokens(doc)
        if tokens > num_tokens and n > 1:
            n -= max(1, (tokens - num_tokens) // per)
        elif num_tokens - tokens > per:
            n += max(1, (num_tokens - tokens) // per)
        else:
            break
        doc = _plant(needles, n)
    return Task(kind, doc, question, answers, distractors, depth, count_tokens(doc), seed)


def spread_depths(trials: int) -> list[float]:
    """``trials`` needle depths spread evenly over 10-90% of the document (rounded to 0.001; one
    trial sits at 10%)."""
    return [round(0.1 + 0.8 * (i / max(1, trials - 1)), 3) for i in range(max(0, trials))]


def task_suite(kinds: tuple[str, ...], sizes: tuple[int, ...], trials: int,
               count_tokens: Callable[[str], int], seed: int = 0) -> list[Task]:
    """``trials`` tasks per kind and size, depths spread evenly over 10-90%, seeded."""
    out = []
    for kind in kinds:
        for size in sizes:
            for i, depth in enumerate(spread_depths(trials)):
                out.append(make_task(kind, size, depth, seed + i, count_tokens))
    return out
