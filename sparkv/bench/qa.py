"""The natural question-answer set of the quality suite: questions about specific passages of the
bundled license texts (``sparkv/data/sample_context.txt``), stored in ``sparkv/data/qa_licenses.json``.

Each question names a *slice* of the sample text (a line range of about 2-4K SmolLM2 tokens: one
license or a few sections of one); the slice is the reusable context
(:func:`sparkv.edge.prompts.chat_context`) and the question its suffix, exactly as the edge asks.
``passage`` is the line range that holds the answer, and ``keywords`` what a right answer contains
(any one, case-insensitive). The suite scores answers against the dense full-precision reference
(``sparkv bench quality``, docs/quality.md); keyword hits are informative only.

Lines are 1-based and inclusive, so the slices do not depend on the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkv.errors import SparkvError

QA_FILE = Path(__file__).resolve().parent.parent / "data" / "qa_licenses.json"


class QASetError(SparkvError):
    """The question-answer file is malformed (a slice out of range, an unknown slice, ...)."""


@dataclass(frozen=True)
class QASlice:
    """A line range of the source text: one context of the QA set.

    Attributes:
        id: short name (``gpl-a``, ``apache``, ...).
        title: what the slice holds.
        lines: ``(first, last)``, 1-based, inclusive.
    """

    id: str
    title: str
    lines: tuple[int, int]


@dataclass(frozen=True)
class QAItem:
    """One question about a passage of a slice.

    Attributes:
        id: unique name (``gpl-a-1``, ...).
        slice: the :class:`QASlice` id whose text is the context.
        question: asked after the context.
        passage: ``(first, last)`` lines (1-based, inclusive) that hold the answer, inside the slice.
        keywords: a right answer contains one of these (case-insensitive).
    """

    id: str
    slice: str
    question: str
    passage: tuple[int, int]
    keywords: tuple[str, ...]

    def keyword_hit(self, answer: str) -> bool:
        """Whether ``answer`` contains one of the keywords (case-insensitive, any whitespace)."""
        low = " ".join(answer.lower().split())
        return any(" ".join(k.lower().split()) in low for k in self.keywords)


@dataclass(frozen=True)
class QASet:
    """The slices, the questions and the source text they index."""

    slices: dict[str, QASlice]
    items: list[QAItem]
    source_lines: list[str]

    def text(self, slice_id: str) -> str:
        """The slice's text (its lines joined, newlines kept)."""
        a, b = self.slices[slice_id].lines
        return "".join(self.source_lines[a - 1:b])

    def passage(self, item: QAItem) -> str:
        """The lines that hold the answer to ``item``."""
        a, b = item.passage
        return "".join(self.source_lines[a - 1:b])

    def by_slice(self) -> dict[str, list[QAItem]]:
        """Questions grouped by slice, in file order."""
        out: dict[str, list[QAItem]] = {}
        for it in self.items:
            out.setdefault(it.slice, []).append(it)
        return out

    def limit(self, n: int | None) -> "QASet":
        """The first ``n`` questions (file order; all when ``n`` is None)."""
        if n is None:
            return self
        return QASet(self.slices, self.items[:max(0, n)], self.source_lines)


def load_qa_set(path: str | Path = QA_FILE) -> QASet:
    """Reads and validates the QA file (raises :class:`QASetError`): the source text exists, every
    slice lies inside it, every question's slice exists and its passage lies inside the slice,
    ids are unique and every question has at least one keyword."""
    path = Path(path)
    try:
        doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        source = path.parent / doc["source"]
        lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
        slices = {s["id"]: QASlice(s["id"], s.get("title", ""), (int(s["lines"][0]),
                                                                  int(s["lines"][1])))
                  for s in doc["slices"]}
        items = [QAItem(q["id"], q["slice"], q["question"],
                        (int(q["passage"][0]), int(q["passage"][1])),
                        tuple(q["keywords"])) for q in doc["questions"]]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise QASetError(f"{path}: {exc}") from exc
    if len(slices) != len(doc["slices"]):
        raise QASetError(f"{path}: duplicate slice ids")
    for s in slices.values():
        a, b = s.lines
        if not 1 <= a <= b <= len(lines):
            raise QASetError(f"{path}: slice {s.id} lines {a}-{b} outside 1-{len(lines)}")
    seen: set[str] = set()
    for it in items:
        if it.id in seen:
            raise QASetError(f"{path}: duplicate question id {it.id}")
        seen.add(it.id)
        if it.slice not in slices:
            raise QASetError(f"{path}: question {it.id} names unknown slice {it.slice!r}")
        a, b = slices[it.slice].lines
        if not a <= it.passage[0] <= it.passage[1] <= b:
            raise QASetError(f"{path}: question {it.id} passage {it.passage} is outside its "
                             f"slice {it.slice} ({a}-{b})")
        if not it.keywords or not it.question.strip():
            raise QASetError(f"{path}: question {it.id} needs a question and keywords")
    return QASet(slices, items, lines)
