"""The measured quality table: which codec levels (and attention backends) keep answers right on
this model. Made once per model by ``sparkv bench quality --save-table`` and stored beside the
latency predictor's profile, at ``<sparkv cache>/predictor/<model fingerprint>.quality.json``.

The planner's quality floor comes from it instead of a fixed ``q5``::

    from sparkv.predictor.quality import quality_floor_for

    floor = quality_floor_for(lm.fingerprint)        # e.g. "q6"; "q5" when no table was made

Per level (stream-only with every chunk at that level, so the codec is measured in isolation) the
table holds, against the dense full-precision reference on the same inputs:

* per retrieval task family (``passkey``, ``multikey``, ``multivalue``): how many tasks, how many
  the dense reference answered correctly, and how many of *those* this level also answered
  correctly (``kept``); ``relative = kept / dense_correct`` (1.0: parity with dense);
* on the natural QA set: mean greedy agreement over 32 tokens, mean teacher-forced top-1 agreement,
  mean first-token KL (nats);
* the bytes streamed per context token at that level.

Version 2 adds, per entry, the verdict of the decision rule (``sparkv.bench.verdict``: pass, fail
or undecided against dense full precision with 95% confidence, each metric's interval and margin)
and the configuration's parameters, and sections beyond levels and backends: ``dtypes``,
``presses`` (``adakv:0.5``), ``device`` (the device service's ratio) and any other group the
benchmark measured. Where an entry has a verdict it decides (:func:`entry_passes`); a version 1
table (no verdicts) is judged by the thresholds as before.

:func:`allowed_levels` turns the table into the levels the default policy may use; docs/quality.md
explains the thresholds and the rule.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, TypedDict

from sparkv.errors import SparkvError
from sparkv.fileio import atomic_write

QUALITY_TABLE_VERSION = 2
#: the versions this sparkv reads (version 1: no verdicts, levels and backends only)
READABLE_VERSIONS = (1, 2)
#: the table section of each benchmark group (any other group is its own section)
SECTION_OF_GROUP = {"level": "levels", "backend": "backends", "dtype": "dtypes",
                    "press": "presses", "device": "device"}
#: the verdict that lets a default use an entry
PASS = "pass"
#: the lossless level: always allowed, whatever the table says
LOSSLESS = "raw"
#: default thresholds of :func:`allowed_levels` (docs/quality.md)
DEFAULT_MIN_PASSKEY = 1.0
DEFAULT_MIN_TEACHER_FORCED = 0.9
#: the default policy's teacher-forced bar: at most ~1% of the reference's tokens mispredicted,
#: about one near-tie per three 32-token answers; the stand-in for the issue's "greedy agreement
#: >= 0.9", which is too noisy to judge one level on a few dozen questions (one near-tie flip of
#: a level with KL ~ 0 costs it 0.08; docs/quality.md)
POLICY_MIN_TEACHER_FORCED = 0.99
#: the thresholds of the default policy (what ``sparkv ask`` does with no flags): pass-key parity
#: and QA teacher-forced agreement >= 0.99 (``sparkv.edge.planning.default_quality_floor``,
#: ``default_backend``)
class PolicyThresholds(TypedDict):
    """The keyword thresholds of :func:`allowed_levels` / :func:`allowed_backends` a policy sets."""

    min_passkey: float | None
    min_teacher_forced: float | None
    min_greedy: float | None


POLICY_THRESHOLDS: PolicyThresholds = {"min_passkey": DEFAULT_MIN_PASSKEY,
                                       "min_teacher_forced": POLICY_MIN_TEACHER_FORCED,
                                       "min_greedy": None}
#: the floor the edge used before the table existed (kept as the fallback)
FALLBACK_FLOOR = "q5"


class QualityTableError(SparkvError):
    """A quality table file is missing fields, of another version or of another model."""


@dataclass(frozen=True)
class RetrievalScore:
    """One retrieval family's result for one level (or backend).

    Attributes:
        n: tasks asked.
        correct: tasks this configuration answered correctly.
        dense_correct: tasks the dense full-precision reference answered correctly.
        kept: tasks both the reference and this configuration answered correctly.
    """

    n: int
    correct: int
    dense_correct: int
    kept: int

    @property
    def accuracy(self) -> float:
        """``correct / n`` (0 when nothing was asked)."""
        return self.correct / self.n if self.n else 0.0

    @property
    def relative(self) -> float | None:
        """``kept / dense_correct``: the share of what dense gets right that this keeps
        (``None`` when dense got nothing right: the family says nothing then)."""
        return self.kept / self.dense_correct if self.dense_correct else None


@dataclass
class QualityEntry:
    """The measured quality of one level (``name`` = ``raw``, ``q8``, ...) or one attention
    backend (``name`` = ``dense``, ``block_sparse``, ...).

    Attributes:
        name: the level or backend.
        retrieval: per task family (``passkey``, ``multikey``, ``multivalue``).
        qa_questions: QA questions asked (0: the QA set was not run).
        qa_greedy_agreement: mean greedy prefix agreement with the reference over 32 tokens.
        qa_teacher_forced: mean teacher-forced top-1 agreement with the reference.
        qa_first_token_kl: mean KL(reference || this) of the first token, nats.
        bytes_per_token: bytes streamed per context token (0 for a local backend).
        verdict: the decision rule's verdict against dense (``sparkv.bench.verdict.Verdict``'s
            dict: ``verdict``, ``summary``, ``need_more``, ``metrics`` with estimate, interval,
            margin per metric); ``None`` in a version 1 table.
        params: what the configuration set (``{"dtype": "bfloat16"}``, ``{"press": "adakv:0.5",
            "ratio": 0.5}``, ``{"ratio": 0.75}``, ...).
    """

    name: str
    retrieval: dict[str, RetrievalScore] = field(default_factory=dict)
    qa_questions: int = 0
    qa_greedy_agreement: float | None = None
    qa_teacher_forced: float | None = None
    qa_first_token_kl: float | None = None
    bytes_per_token: float | None = None
    verdict: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict_name(self) -> str | None:
        """``pass``, ``fail``, ``undecided`` or ``None`` (no verdict recorded)."""
        return None if not self.verdict else str(self.verdict.get("verdict"))

    @property
    def verdict_summary(self) -> str:
        """The verdict's one-line summary (``undecided: need 12 more QA questions``; ``-``)."""
        if not self.verdict:
            return "-"
        return str(self.verdict.get("summary") or self.verdict.get("verdict"))

    @property
    def passkey_relative(self) -> float | None:
        """Pass-key accuracy relative to dense (``kept / dense_correct``; ``None``: not run)."""
        s = self.retrieval.get("passkey")
        return s.relative if s is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name,
                "retrieval": {k: {"n": v.n, "correct": v.correct,
                                  "dense_correct": v.dense_correct, "kept": v.kept,
                                  "relative": v.relative}
                              for k, v in self.retrieval.items()},
                "passkey_relative": self.passkey_relative,
                "qa_questions": self.qa_questions,
                "qa_greedy_agreement": self.qa_greedy_agreement,
                "qa_teacher_forced": self.qa_teacher_forced,
                "qa_first_token_kl": self.qa_first_token_kl,
                "bytes_per_token": self.bytes_per_token, "verdict": self.verdict,
                "params": self.params}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QualityEntry":
        return cls(str(d["name"]),
                   {str(k): RetrievalScore(int(v["n"]), int(v["correct"]),
                                           int(v["dense_correct"]), int(v["kept"]))
                    for k, v in (d.get("retrieval") or {}).items()},
                   int(d.get("qa_questions", 0)), _opt(d.get("qa_greedy_agreement")),
                   _opt(d.get("qa_teacher_forced")), _opt(d.get("qa_first_token_kl")),
                   _opt(d.get("bytes_per_token")),
                   dict(d["verdict"]) if d.get("verdict") else None, dict(d.get("params") or {}))


@dataclass
class QualityTable:
    """Measured quality per codec level (best quality first) and per attention backend.

    Attributes:
        model_fingerprint: the model's fingerprint (``LoadedModel.fingerprint``).
        model_name: its name, for the reader.
        measured_unix: when it was measured (seconds since the epoch).
        levels: one entry per level, best quality first (the codec's order).
        backends: one entry per local attention backend (may be empty).
        source: how it was measured (the benchmark's configuration: sizes, trials, tasks).
        num_layers: the model's depth (the codec's per-layer bits depend on it).
        codec_signature: :func:`codec_signature` of the codec that was measured (empty: not
            recorded); a table of another codec says nothing about this one.
        sections: the other sections, by name (``dtypes``, ``presses``, ``device``, ...; see
            :data:`SECTION_OF_GROUP`), each a list of entries in the order measured.
    """

    model_fingerprint: str
    model_name: str = ""
    measured_unix: float = field(default_factory=time.time)
    levels: list[QualityEntry] = field(default_factory=list)
    backends: list[QualityEntry] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)
    num_layers: int = 0
    codec_signature: str = ""
    sections: dict[str, list[QualityEntry]] = field(default_factory=dict)

    def section(self, name: str) -> list[QualityEntry]:
        """The entries of section ``name`` (``levels``, ``backends``, ``dtypes``, ``presses``,
        ``device``, ...); empty when it was not measured."""
        if name == "levels":
            return self.levels
        if name == "backends":
            return self.backends
        return self.sections.get(name, [])

    def entry(self, section: str, name: str) -> QualityEntry | None:
        """The entry ``name`` of ``section`` (``None`` when it was not measured)."""
        return next((e for e in self.section(section) if e.name == name), None)

    def section_names(self) -> list[str]:
        """Every non-empty section, levels and backends first."""
        return [n for n in ("levels", "backends", *self.sections) if self.section(n)]

    def has_verdicts(self) -> bool:
        """Whether any entry carries the decision rule's verdict (a version 2 build)."""
        return any(e.verdict for n in self.section_names() for e in self.section(n))

    def matches_codec(self) -> bool:
        """Whether the codec in this process is the one measured (true when the table did not
        record one)."""
        if not self.codec_signature or not self.num_layers:
            return True
        return codec_signature(self.num_layers) == self.codec_signature

    def level(self, name: str) -> QualityEntry | None:
        """The entry of level ``name`` (``None`` when it was not measured)."""
        return next((e for e in self.levels if e.name == name), None)

    def backend(self, name: str) -> QualityEntry | None:
        """The entry of backend ``name`` (``None`` when it was not measured)."""
        return next((e for e in self.backends if e.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"version": QUALITY_TABLE_VERSION, "model_fingerprint": self.model_fingerprint,
                "model_name": self.model_name, "measured_unix": self.measured_unix,
                "levels": [e.to_dict() for e in self.levels],
                "backends": [e.to_dict() for e in self.backends], "source": self.source,
                "num_layers": self.num_layers, "codec_signature": self.codec_signature,
                "sections": {k: [e.to_dict() for e in v] for k, v in self.sections.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QualityTable":
        """Parses :meth:`to_dict`'s output (raises :class:`QualityTableError`)."""
        try:
            if int(d.get("version", 0)) not in READABLE_VERSIONS:
                raise QualityTableError(f"quality table version {d.get('version')!r}, this "
                                        f"sparkv reads {list(READABLE_VERSIONS)}")
            return cls(str(d["model_fingerprint"]), str(d.get("model_name", "")),
                       float(d["measured_unix"]),
                       [QualityEntry.from_dict(e) for e in d.get("levels") or []],
                       [QualityEntry.from_dict(e) for e in d.get("backends") or []],
                       dict(d.get("source") or {}), int(d.get("num_layers", 0)),
                       str(d.get("codec_signature", "")),
                       {str(k): [QualityEntry.from_dict(e) for e in v or []]
                        for k, v in (d.get("sections") or {}).items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise QualityTableError(f"malformed quality table: {exc!r}") from exc

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Writes the table as JSON (atomically); default :func:`quality_table_path`."""
        out = Path(path) if path else quality_table_path(self.model_fingerprint)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, (json.dumps(self.to_dict(), indent=1) + "\n").encode())
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "QualityTable":
        """Reads a table written by :meth:`save` (raises :class:`QualityTableError`)."""
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise QualityTableError(f"cannot read the quality table {path}: {exc}") from exc
        if not isinstance(doc, dict):
            raise QualityTableError(f"{path}: not a JSON object")
        return cls.from_dict(doc)


def codec_signature(num_layers: int) -> str:
    """What the table's numbers depend on in the codec: the frame format version and every
    level's K and V bits per layer for a model of ``num_layers`` layers (16 hex digits of a
    SHA-256). A codec change that moves a level's bits or the format changes it; a table whose
    signature differs was measured on another codec."""
    from sparkv.codec import LEVELS, VERSION

    doc = {"frame_version": VERSION,
           "levels": {name: [lv.k_bits_per_layer(num_layers), lv.v_bits_per_layer(num_layers)]
                      for name, lv in LEVELS.items()}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def quality_table_path(model_fingerprint: str) -> Path:
    """``<sparkv cache>/predictor/<model fingerprint>.quality.json``, beside the latency
    predictor's ``<fingerprint>.json`` (:func:`sparkv.predictor.commands.default_model_path`)."""
    from sparkv.runtime.model import cache_dir

    return cache_dir() / "predictor" / f"{model_fingerprint}.quality.json"


def bundled_quality_table_path(model_fingerprint: str) -> Path:
    """``sparkv/data/quality-<fingerprint>.json``: the table measured for a bundled model and
    shipped with the package (the bundled SmolLM2's), used when this machine has made none."""
    return Path(__file__).resolve().parent.parent / "data" / f"quality-{model_fingerprint}.json"


def load_quality_table(model_fingerprint: str, path: str | os.PathLike[str] | None = None
                       ) -> QualityTable | None:
    """The table of this model (default path: :func:`quality_table_path`, else the table shipped
    for a bundled model, :func:`bundled_quality_table_path`), or ``None`` when none was made. Raises :class:`QualityTableError` when the file is unreadable or belongs to another
    model."""
    p = Path(path) if path else quality_table_path(model_fingerprint)
    if not path and not p.is_file():
        p = bundled_quality_table_path(model_fingerprint)
    if not p.is_file():
        return None
    table = QualityTable.load(p)
    if table.model_fingerprint != model_fingerprint:
        raise QualityTableError(f"{p} was measured on model {table.model_fingerprint}, not "
                                f"{model_fingerprint}")
    return table


def entry_keeps_quality(entry: QualityEntry, min_passkey: float | None = DEFAULT_MIN_PASSKEY,
                        min_teacher_forced: float | None = DEFAULT_MIN_TEACHER_FORCED,
                        min_greedy: float | None = None,
                        max_first_token_kl: float | None = None) -> bool:
    """Whether one entry meets every threshold that is not ``None``. A metric the table lacks
    (the family or the QA set was not run) fails its threshold: unmeasured is not proven."""
    checks: list[tuple[float | None, float | None, bool]] = [
        (entry.passkey_relative, min_passkey, True),
        (entry.qa_teacher_forced, min_teacher_forced, True),
        (entry.qa_greedy_agreement, min_greedy, True),
        (entry.qa_first_token_kl, max_first_token_kl, False),
    ]
    for value, bound, at_least in checks:
        if bound is None:
            continue
        if value is None or not math.isfinite(value):
            return False
        # a tiny tolerance: 29/30 must pass a 29/30 bound however it was rounded
        if at_least and value < bound - 1e-9:
            return False
        if not at_least and value > bound + 1e-9:
            return False
    return True


def entry_passes(entry: QualityEntry, use_verdicts: bool = True, **thresholds: Any) -> bool:
    """Whether a default may use this entry: its recorded verdict is ``pass`` (an entry with a
    verdict: ``fail`` and ``undecided`` do not pass), else (a version 1 entry, or
    ``use_verdicts=False``) :func:`entry_keeps_quality` under ``thresholds``."""
    if use_verdicts and entry.verdict:
        return entry.verdict_name == PASS
    return entry_keeps_quality(entry, **thresholds)


def allowed_levels(table: QualityTable, min_passkey: float | None = DEFAULT_MIN_PASSKEY,
                   min_teacher_forced: float | None = DEFAULT_MIN_TEACHER_FORCED, *,
                   min_greedy: float | None = None,
                   max_first_token_kl: float | None = None,
                   use_verdicts: bool = True) -> list[str]:
    """The codec levels the default policy may stream, best quality first.

    A level keeps quality when (thresholds set to ``None`` are not checked):

    * ``passkey_relative >= min_passkey``: of the pass-key tasks the dense reference answers,
      the share this level also answers (1.0, the default: parity; the issue's "29 of 30 where
      dense gets 30 of 30" is ``min_passkey=29/30``);
    * ``qa_teacher_forced >= min_teacher_forced`` (default 0.9) on the natural QA set;
    * optionally ``qa_greedy_agreement >= min_greedy`` and ``qa_first_token_kl <=
      max_first_token_kl``.

    The result is a prefix of the table's levels: the walk from the best level down stops at the
    first level that fails, so it is always "every level down to a floor" (a noisy pass of a lower
    level below a failing one is not trusted). ``raw`` is lossless and always passes. The last
    element is the quality floor (:func:`quality_floor`); an empty list means not even the best
    measured level keeps quality.

    An entry with the decision rule's verdict (a version 2 table) is judged by it instead
    (:func:`entry_passes`: only ``pass`` passes; ``use_verdicts=False`` ignores verdicts).
    """
    out: list[str] = []
    for entry in table.levels:
        if entry.name != LOSSLESS and not entry_passes(
                entry, use_verdicts, min_passkey=min_passkey,
                min_teacher_forced=min_teacher_forced, min_greedy=min_greedy,
                max_first_token_kl=max_first_token_kl):
            break
        out.append(entry.name)
    return out


def allowed_backends(table: QualityTable, min_passkey: float | None = DEFAULT_MIN_PASSKEY,
                     min_teacher_forced: float | None = DEFAULT_MIN_TEACHER_FORCED, *,
                     min_greedy: float | None = None,
                     max_first_token_kl: float | None = None,
                     use_verdicts: bool = True) -> list[str]:
    """The local attention backends that keep quality (same thresholds and verdicts as
    :func:`allowed_levels`; each backend judged on its own, in the table's order)."""
    return [e.name for e in table.backends if entry_passes(
        e, use_verdicts, min_passkey=min_passkey, min_teacher_forced=min_teacher_forced,
        min_greedy=min_greedy, max_first_token_kl=max_first_token_kl)]


def quality_floor(table: QualityTable, min_passkey: float | None = DEFAULT_MIN_PASSKEY,
                  min_teacher_forced: float | None = DEFAULT_MIN_TEACHER_FORCED, **kw: Any
                  ) -> str | None:
    """The lowest level of :func:`allowed_levels` (``None`` when no level passes)."""
    levels = allowed_levels(table, min_passkey, min_teacher_forced, **kw)
    return levels[-1] if levels else None


def usable_table(model_fingerprint: str, path: str | os.PathLike[str] | None = None,
                 check_codec: bool = True) -> QualityTable | None:
    """This model's stored table, or ``None`` when no table was made, it cannot be read, or
    (``check_codec``) it was measured on another codec (:meth:`QualityTable.matches_codec`; both
    with a warning). Never raises for a missing or bad table: answering must not depend on it."""
    try:
        table = load_quality_table(model_fingerprint, path)
    except QualityTableError as exc:
        warnings.warn(f"ignoring the quality table: {exc}", stacklevel=3)
        return None
    if table is None:
        return None
    if check_codec and not table.matches_codec():
        warnings.warn(f"ignoring the quality table of {model_fingerprint}: it was measured on "
                      "another codec (re-run `sparkv bench quality --save-table`)", stacklevel=3)
        return None
    return table


def allowed_levels_for(model_fingerprint: str, path: str | os.PathLike[str] | None = None,
                       **thresholds: Any) -> list[str] | None:
    """:func:`allowed_levels` of this model's stored table (``thresholds`` as there), or ``None``
    when there is no usable table (:func:`usable_table`: missing, unreadable or of another codec;
    the last two with a warning). Never raises for a missing or bad table."""
    table = usable_table(model_fingerprint, path)
    return None if table is None else allowed_levels(table, **thresholds)


def allowed_backends_for(model_fingerprint: str, path: str | os.PathLike[str] | None = None,
                         **thresholds: Any) -> list[str] | None:
    """:func:`allowed_backends` of this model's stored table, or ``None`` when there is no usable
    table or it measured no backend (never raises; warns like :func:`allowed_levels_for`)."""
    table = usable_table(model_fingerprint, path, check_codec=False)
    if table is None or not table.backends:
        return None
    return allowed_backends(table, **thresholds)


def quality_floor_for(model_fingerprint: str, fallback: str = FALLBACK_FLOOR,
                      path: str | os.PathLike[str] | None = None, **thresholds: Any) -> str:
    """The quality floor the default policy should use for this model: the last of
    :func:`allowed_levels_for`; ``fallback`` (``q5``, the floor before tables existed) when there
    is no usable table; ``raw`` when a table exists but no lossy level passes."""
    levels = allowed_levels_for(model_fingerprint, path, **thresholds)
    if levels is None:
        return fallback
    return levels[-1] if levels else LOSSLESS


def _opt(x: Any) -> float | None:
    return None if x is None else float(x)


# ---- the other sections: one verdict per configuration ------------------------------------------
def entry_for(model_fingerprint: str, section: str, name: str,
              path: str | os.PathLike[str] | None = None) -> QualityEntry | None:
    """The entry ``name`` of ``section`` in this model's usable table (:func:`usable_table`;
    the codec is checked only for ``levels``), or ``None``. Never raises."""
    table = usable_table(model_fingerprint, path, check_codec=section == "levels")
    return None if table is None else table.entry(section, name)


def verdict_for(model_fingerprint: str, section: str, name: str,
                path: str | os.PathLike[str] | None = None) -> str | None:
    """``pass``, ``fail`` or ``undecided`` for entry ``name`` of ``section``; ``None`` when there
    is no usable table, no such entry, or the entry has no verdict (a version 1 table)."""
    e = entry_for(model_fingerprint, section, name, path)
    return None if e is None else e.verdict_name


def table_dtype_passes(model_fingerprint: str, dtype: str,
                       path: str | os.PathLike[str] | None = None) -> bool | None:
    """Whether the table's ``dtypes`` entry of ``dtype`` (a compute configuration: ``bfloat16``,
    ``mixed``, ...) passes:
    ``True``/``False``, or ``None`` when it has no verdict for it (then behave as today)."""
    v = verdict_for(model_fingerprint, "dtypes", dtype, path)
    return None if v is None else v == PASS


def table_verdicts(model_fingerprint: str, table_path: str | os.PathLike[str] | None = None
                   ) -> dict[str, bool | None]:
    """Per configuration ``auto`` may take, whether the model's table passes it (``None``: no
    verdict). ``mixed-layers`` counts only where its per-layer selection is stored for the
    model (without one it cannot be built)."""
    from sparkv.runtime.compute import CONFIGS
    from sparkv.runtime.layerprec import load_precision

    out: dict[str, bool | None] = {}
    for name, config in CONFIGS.items():
        if name == "float32":
            continue
        verdict = table_dtype_passes(model_fingerprint, name, table_path)
        if verdict and config.per_layer and load_precision(model_fingerprint) is None:
            verdict = None
        out[name] = verdict
    return out


def device_ratio_for(model_fingerprint: str, fallback: float = 1.0,
                     path: str | os.PathLike[str] | None = None, ladder: str | None = None,
                     old_ladder: str | None = None) -> float:
    """The device service's default tolerance ratio: the smallest (most compressing) ratio of
    the ``device`` section whose verdict passes, every larger measured ratio passing too (the
    walk from the largest ratio down stops at the first that does not pass, as levels do);
    ``fallback`` (1.0, every chunk at int8) without a verdict or when none passes. ``ladder``:
    only entries measured with the service's level ladder count (an entry without one was
    measured with ``old_ladder``); ``None``: every entry."""
    table = usable_table(model_fingerprint, path, check_codec=False)
    if table is None:
        return fallback
    ratios = sorted(((float(e.params["ratio"]), e) for e in table.section("device")
                     if e.verdict and e.params.get("ratio") is not None
                     and (ladder is None or e.params.get("ladder", old_ladder) == ladder)),
                    key=lambda x: -x[0])
    best = None
    for ratio, entry in ratios:
        if entry.verdict_name != PASS:
            break
        best = ratio
    return fallback if best is None else best


def passing_entries(table: QualityTable, section: str) -> list[QualityEntry]:
    """The entries of ``section`` whose verdict passes, in the table's order."""
    return [e for e in table.section(section) if e.verdict_name == PASS]


def press_warning(model_fingerprint: str, spec: str,
                  path: str | os.PathLike[str] | None = None) -> str | None:
    """The warning a server gives with a context compressed by press ``spec`` (canonical, e.g.
    ``adakv:0.5``) when the model's table has a ``presses`` entry of that spec whose verdict is
    ``fail`` (answers inferior to the uncompressed context's with 95% confidence); ``None``
    otherwise (a pass, an undecided verdict, or no row: as before tables judged presses). ASCII
    only: it also travels as an HTTP header."""
    e = entry_for(model_fingerprint, "presses", spec, path)
    if e is None or e.verdict_name != "fail":
        return None
    text = (f"press {spec} fails this model's quality table ({e.verdict_summary}): its answers "
            "are inferior to the uncompressed context's with 95% confidence (docs/quality.md)")
    return text.encode("ascii", "replace").decode("ascii")


def table_cpu_dtype(model_fingerprint: str, path: str | os.PathLike[str] | None = None,
                    cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> str:
    """The compute configuration ``--dtype auto`` takes on a CPU: the first of
    :data:`~sparkv.runtime.compute.CPU_BF16_ORDER` the model's table passes when the CPU has
    bf16 hardware, else ``float32`` (:func:`sparkv.runtime.compute.auto_compute`). The loaders
    use it through :func:`sparkv.predictor.dtypes.choose_dtype` (docs/dtypes.md)."""
    import torch

    from sparkv.runtime.compute import auto_compute

    config, _ = auto_compute(torch.device("cpu"), table_verdicts(model_fingerprint, path),
                             cpuinfo)
    return config.name


def describe_table(table: QualityTable) -> list[str]:
    """One line per section: each entry's name and verdict (``q8 pass, q5 undecided: need 12
    more QA questions``); a version 1 entry shows its QA teacher-forced mean instead."""
    lines = []
    for section in table.section_names():
        cells = []
        for e in table.section(section):
            if e.verdict:
                cells.append(f"{e.name} {e.verdict_summary}")
            else:
                tf = "-" if e.qa_teacher_forced is None else f"{e.qa_teacher_forced:.3f}"
                cells.append(f"{e.name} (no verdict; teacher-forced {tf})")
        lines.append(f"{section}: " + "; ".join(cells))
    return lines
