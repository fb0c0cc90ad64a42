"""The natural question-answer sets of the quality suite: questions about specific passages of
bundled texts of several *kinds*, one JSON file per set (``sparkv/data/qa_*.json``):

* ``qa_licenses.json`` (kind ``license``): the GPL-3, Apache-2.0 and MPL-2.0 texts of
  ``sample_context.txt``;
* ``qa_manual.json`` (``manual``), ``qa_meeting.json`` (``transcript``), ``qa_code.json``
  (``code``), ``qa_story.json`` (``narrative``): original texts written for sparkv (a device
  manual, a committee meeting, a Python module with its comments, a short story).

Each file names its source text (``source``, relative to the file) and its ``kind``. Each question
names a *slice* of its source (a line range of about 1.5-4K SmolLM2 tokens); the slice is the
reusable context (:func:`sparkv.edge.prompts.chat_context`) and the question its suffix, exactly as
the edge asks. ``passage`` is the line range that holds the answer, and ``keywords`` what a right
answer contains (any one, case-insensitive). The suite scores answers against the dense
full-precision reference (``sparkv bench quality``, docs/quality.md); keyword hits are informative
only.

Lines are 1-based and inclusive, so the slices do not depend on the tokenizer. Slice and question
ids are unique over every set loaded together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from sparkv.errors import SparkvError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
QA_FILE = DATA_DIR / "qa_licenses.json"
DEFAULT_KIND = "other"  # a set whose file names no kind


class QASetError(SparkvError):
    """A question-answer file is malformed (a slice out of range, an unknown slice, a missing
    source text, an id used twice, ...)."""


@dataclass(frozen=True)
class QASlice:
    """A line range of a source text: one context of the QA set.

    Attributes:
        id: short name (``gpl-a``, ``apache``, ``hx40``, ...), unique over the sets loaded.
        title: what the slice holds.
        lines: ``(first, last)``, 1-based, inclusive.
        kind: the kind of text (``license``, ``manual``, ``transcript``, ``code``, ``narrative``).
        source: the path of the source text the lines index.
    """

    id: str
    title: str
    lines: tuple[int, int]
    kind: str = DEFAULT_KIND
    source: str = ""


@dataclass(frozen=True)
class QAItem:
    """One question about a passage of a slice.

    Attributes:
        id: unique name (``gpl-a-1``, ``hx40-3``, ...).
        slice: the :class:`QASlice` id whose text is the context.
        question: asked after the context.
        passage: ``(first, last)`` lines (1-based, inclusive) that hold the answer, inside the slice.
        keywords: a right answer contains one of these (case-insensitive).
        kind: the kind of its slice's text (as :attr:`QASlice.kind`).
    """

    id: str
    slice: str
    question: str
    passage: tuple[int, int]
    keywords: tuple[str, ...]
    kind: str = DEFAULT_KIND

    def keyword_hit(self, answer: str) -> bool:
        """Whether ``answer`` contains one of the keywords (case-insensitive, any whitespace)."""
        low = " ".join(answer.lower().split())
        return any(" ".join(k.lower().split()) in low for k in self.keywords)


@dataclass(frozen=True)
class QASet:
    """The slices, the questions and the source texts they index (lines kept, by source path)."""

    slices: dict[str, QASlice]
    items: list[QAItem]
    sources: dict[str, list[str]]

    @property
    def source_lines(self) -> list[str]:
        """The lines of the set's only source text (a set of one file)."""
        if len(self.sources) != 1:
            raise QASetError(f"the set has {len(self.sources)} source texts; use text()")
        return next(iter(self.sources.values()))

    def _lines(self, slice_id: str, span: tuple[int, int]) -> str:
        a, b = span
        return "".join(self.sources[self.slices[slice_id].source][a - 1:b])

    def text(self, slice_id: str) -> str:
        """The slice's text (its lines joined, newlines kept)."""
        return self._lines(slice_id, self.slices[slice_id].lines)

    def passage(self, item: QAItem) -> str:
        """The lines that hold the answer to ``item``."""
        return self._lines(item.slice, item.passage)

    def by_slice(self) -> dict[str, list[QAItem]]:
        """Questions grouped by slice, in file order."""
        out: dict[str, list[QAItem]] = {}
        for it in self.items:
            out.setdefault(it.slice, []).append(it)
        return out

    def by_kind(self) -> dict[str, list[QAItem]]:
        """Questions grouped by the kind of their text, in file order."""
        out: dict[str, list[QAItem]] = {}
        for it in self.items:
            out.setdefault(it.kind, []).append(it)
        return out

    def limit(self, n: int | None) -> "QASet":
        """The first ``n`` questions (file order; all when ``n`` is None)."""
        if n is None:
            return self
        return QASet(self.slices, self.items[:max(0, n)], self.sources)


def bundled_qa_files() -> list[Path]:
    """Every bundled set (``sparkv/data/qa_*.json``): the license set first (its questions keep
    their place, so ``limit(n)`` asks what it always asked), then the others by file name."""
    rest = sorted(p for p in DATA_DIR.glob("qa_*.json") if p != QA_FILE)
    return [QA_FILE, *rest]


def qa_paths(spec: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """The QA files named by ``spec``: ``None`` (or an empty string) means every bundled set
    (:func:`bundled_qa_files`); a string may name several files separated by commas."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return bundled_qa_files()
    if isinstance(spec, Path):
        return [spec]
    parts = spec.split(",") if isinstance(spec, str) else [str(p) for p in spec]
    paths = [Path(p.strip()) for p in parts if p.strip()]
    if not paths:
        raise QASetError(f"no QA file named in {spec!r}")
    return paths


def load_qa_sets(spec: str | Path | Sequence[str | Path] | None = None) -> QASet:
    """Reads, validates and joins several QA files (every bundled set by default; see
    :func:`qa_paths`) into one :class:`QASet`, questions in file order. Raises
    :class:`QASetError` on a bad file or a slice or question id that two files share."""
    slices: dict[str, QASlice] = {}
    items: list[QAItem] = []
    sources: dict[str, list[str]] = {}
    slice_file: dict[str, Path] = {}
    item_file: dict[str, Path] = {}
    for path in qa_paths(spec):
        one = load_qa_set(path)
        for sid, s in one.slices.items():
            if sid in slices:
                raise QASetError(f"{path}: slice id {sid!r} is also used by {slice_file[sid]}")
            slices[sid], slice_file[sid] = s, path
        for it in one.items:
            if it.id in item_file:
                raise QASetError(f"{path}: question id {it.id!r} is also used by "
                                 f"{item_file[it.id]}")
            item_file[it.id] = path
        items.extend(one.items)
        sources.update(one.sources)
    return QASet(slices, items, sources)


def load_qa_set(path: str | Path = QA_FILE) -> QASet:
    """Reads and validates one QA file (raises :class:`QASetError`): the source text exists, every
    slice lies inside it, every question's slice exists and its passage lies inside the slice,
    ids are unique and every question has a question and at least one keyword."""
    path = Path(path)
    doc = _read_doc(path)
    source = path.parent / str(doc["source"])
    if not source.is_file():
        raise QASetError(f"{path}: its source text {source} does not exist")
    try:
        lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    except (OSError, UnicodeDecodeError) as exc:
        raise QASetError(f"{path}: cannot read its source text {source}: {exc}") from exc
    slices, items = _parse(path, doc, str(source))
    _check(path, slices, items, len(lines))
    return QASet(slices, items, {str(source): lines})


def _read_doc(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise QASetError(f"cannot read QA file {path}: {exc}") from exc
    except ValueError as exc:
        raise QASetError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise QASetError(f"{path}: expected a JSON object")
    missing = [k for k in ("source", "slices", "questions") if k not in doc]
    if missing:
        raise QASetError(f"{path}: missing {', '.join(missing)}")
    return doc


def _parse(path: Path, doc: dict[str, Any], source: str
           ) -> tuple[dict[str, QASlice], list[QAItem]]:
    kind = doc.get("kind", DEFAULT_KIND)
    if not isinstance(kind, str) or not kind.strip():
        raise QASetError(f"{path}: kind must be a non-empty string, not {kind!r}")
    try:
        slices = [QASlice(str(s["id"]), str(s.get("title", "")), _span(s["lines"]), kind, source)
                  for s in doc["slices"]]
        items = [QAItem(str(q["id"]), str(q["slice"]), str(q["question"]), _span(q["passage"]),
                        tuple(str(k) for k in q["keywords"]), kind) for q in doc["questions"]]
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise QASetError(f"{path}: malformed slice or question: {exc!r}") from exc
    by_id = {s.id: s for s in slices}
    if len(by_id) != len(slices):
        raise QASetError(f"{path}: duplicate slice ids")
    return by_id, items


def _span(value: Any) -> tuple[int, int]:
    a, b = value
    if isinstance(a, bool) or isinstance(b, bool):
        raise TypeError(f"line numbers must be integers, not {value!r}")
    return int(a), int(b)


def _check(path: Path, slices: dict[str, QASlice], items: list[QAItem], n_lines: int) -> None:
    for s in slices.values():
        a, b = s.lines
        if not 1 <= a <= b <= n_lines:
            raise QASetError(f"{path}: slice {s.id} lines {a}-{b} outside 1-{n_lines}")
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
        if not it.question.strip() or not any(k.strip() for k in it.keywords):
            raise QASetError(f"{path}: question {it.id} needs a question and keywords")
