"""The quality decision rule: is a configuration non-inferior to dense full precision?

Pure (numpy only). Input: the answer rows of ``sparkv bench quality`` (``score_answer`` /
``base_row``: ``probe``, ``family``, ``config``, ``group``, ``correct``, ``error``,
``greedy_agreement``, ``teacher_forced``, ``first_token_kl``; any ``group`` name). Each
configuration is compared with the ``dense`` rows on the same tasks, **paired by probe id**:

==================  ==========================================  =================  ==========
metric              estimate                                    test               margin
==================  ==========================================  =================  ==========
retrieval_relative  kept / dense_correct (retrieval families)   exact Clopper-     >= 0.95
                                                                Pearson bounds
teacher_forced_drop mean over QA questions of dense - config    paired bootstrap   <= 0.015
first_token_kl      mean KL(dense || config) of the 1st token   paired bootstrap   <= 0.01
greedy_drop         mean of dense - config greedy agreement     paired bootstrap   <= 0.25,
                                                                                   fail-only
==================  ==========================================  =================  ==========

Every bound is one-sided at 95% (the interval reported is the two one-sided 95% bounds, a 90%
two-sided interval). A metric **passes** when its bound on the bad side clears the margin, **fails**
when its bound on the good side is beyond the margin (the interval lies wholly beyond it), and is
**undecided** otherwise, with an estimate of how many more tasks would decide it. A configuration
passes when every primary metric it was measured on passes (and at least one was measured), fails
when any metric fails, and is undecided otherwise (docs/quality.md, "The decision rule").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

#: one-sided confidence of every bound
CONFIDENCE = 0.95
#: the z of a one-sided 95% normal bound (sample-size estimates only)
Z_ONE_SIDED = 1.6449
#: retrieval: a configuration must keep at least this share of the tasks dense answers. 0.95: one
#: needle in twenty lost is the most we accept as "the same model"; proving it takes 59
#: dense-correct tasks all kept (0.05 ** (1 / 59) > 0.95), i.e. two sizes of the issue's 30
#: trials, and one miss in 90 still passes only with a few more tasks.
RETRIEVAL_MIN_RELATIVE = 0.95
#: QA teacher-forced agreement: the mean drop against dense (1.0 by definition) at most 1.5 points,
#: half a token of a 32-token answer. SmolLM2's reference has near-ties (top-2 logits within 0.05)
#: that even practically lossless perturbations flip: q8 (first-token KL 1.5e-5) already loses
#: 0.006; the margin is 2.5x that floor, and block-sparse attention's 0.028 lies beyond it.
TEACHER_FORCED_MAX_DROP = 0.015
#: first-token KL(dense || config), nats. 0.01 bounds the first token's total-variation distance
#: by sqrt(0.01 / 2) = 0.07 (Pinsker): the answer's first token changes only where dense's own top
#: two are within 7 points of probability. Every codec level measured so far is below 5e-4; a
#: garbling press is far above.
FIRST_TOKEN_KL_MAX = 0.01
#: greedy agreement gates only as a failure guard: a configuration fails when, with 95%
#: confidence, it loses more than a quarter of the dense answer's tokens on average. Near-tie
#: flips (one flip at token 2 costs 0.97 on that answer) make greedy agreement too noisy to
#: *prove* non-inferiority on a few dozen questions, so it never makes a configuration pass.
GREEDY_MAX_DROP = 0.25
#: below this many paired questions the percentile bootstrap undercovers (three equal answers
#: give a zero-width interval): a bootstrap metric stays undecided until it has this many
MIN_PAIRED = 20
#: bootstrap resamples (seeded)
RESAMPLES = 4000
#: the largest "need N more" estimated; beyond it the answer is "not decidable at this rate"
MAX_NEED = 100_000

PASS, FAIL, UNDECIDED = "pass", "fail", "undecided"
#: the metrics whose verdicts decide a pass (greedy_drop can only fail a configuration)
PRIMARY = ("retrieval_relative", "teacher_forced_drop", "first_token_kl")
QA_FAMILY = "qa"
DENSE = "dense"


@dataclass(frozen=True)
class MetricVerdict:
    """One metric of one configuration against dense.

    Attributes:
        metric: ``retrieval_relative``, ``teacher_forced_drop``, ``first_token_kl`` or
            ``greedy_drop``.
        estimate: the point estimate (``None``: nothing to estimate, e.g. dense answered no task).
        interval: ``(lower, upper)``, each a one-sided 95% bound (``None`` with no estimate).
        margin: the non-inferiority margin, in the estimate's units.
        higher_is_better: ``True`` for ``retrieval_relative`` (pass: lower >= margin), ``False``
            for the others (pass: upper <= margin).
        n: paired tasks (retrieval: dense-correct tasks; QA: questions).
        verdict: ``pass``, ``fail`` or ``undecided``.
        need_more: undecided only: about how many more tasks would decide it at the observed
            rate and spread (``None``: decided, or not decidable at this rate).
        gates: ``False`` for a report-only metric that can fail but never pass a configuration.
    """

    metric: str
    estimate: float | None
    interval: tuple[float, float] | None
    margin: float
    higher_is_better: bool
    n: int
    verdict: str
    need_more: int | None = None
    gates: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "estimate": self.estimate,
                "interval": list(self.interval) if self.interval is not None else None,
                "margin": self.margin, "higher_is_better": self.higher_is_better, "n": self.n,
                "verdict": self.verdict, "need_more": self.need_more, "gates": self.gates}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MetricVerdict":
        iv = d.get("interval")
        return cls(str(d["metric"]), _opt(d.get("estimate")),
                   (float(iv[0]), float(iv[1])) if iv is not None else None,
                   float(d["margin"]), bool(d["higher_is_better"]), int(d["n"]),
                   str(d["verdict"]), None if d.get("need_more") is None else int(d["need_more"]),
                   bool(d.get("gates", True)))

    def text(self) -> str:
        """``0.994 [0.990, 0.997] >= 0.95 pass`` style, for tables."""
        if self.estimate is None or self.interval is None:
            return f"- (n={self.n}) {self.verdict}"
        op = ">=" if self.higher_is_better else "<="
        d = 4 if self.metric == "first_token_kl" else 3
        lo, hi = self.interval
        more = f" +{self.need_more}" if self.need_more is not None else ""
        return (f"{self.estimate:.{d}f} [{lo:.{d}f},{hi:.{d}f}] {op}{self.margin:g} "
                f"{self.verdict}{more}")


@dataclass
class Verdict:
    """The verdict of one configuration against dense full precision.

    Attributes:
        config: the configuration's name (``stream@q5``, ``local/block_sparse``, ...).
        group: its group (``level``, ``backend``, ``dtype``, ``press``, ``device``, ...).
        verdict: ``pass``, ``fail`` or ``undecided``.
        metrics: per measured metric, its :class:`MetricVerdict`.
        need_more: undecided only: the most any undecided primary metric needs (``None``: decided
            or not decidable at the observed rate).
        errors: answers that raised (counted as wrong: not kept, agreement 0).
    """

    config: str
    group: str
    verdict: str
    metrics: dict[str, MetricVerdict] = field(default_factory=dict)
    need_more: int | None = None
    errors: int = 0

    @property
    def passes(self) -> bool:
        return self.verdict == PASS

    def summary(self) -> str:
        """``pass``, ``FAIL (teacher_forced_drop)`` or ``undecided: need 12 more tasks``."""
        if self.verdict == FAIL:
            bad = [m.metric for m in self.metrics.values() if m.verdict == FAIL]
            return f"FAIL ({', '.join(bad)})"
        if self.verdict == UNDECIDED:
            if not any(m.gates for m in self.metrics.values()):
                return "undecided: no primary metric measured"
            if self.need_more is None:
                return "undecided: not decidable at the observed rate"
            need: dict[str, int] = {}
            for m in self.metrics.values():
                if m.gates and m.verdict == UNDECIDED and m.need_more is not None:
                    what = ("dense-correct retrieval tasks" if m.metric == "retrieval_relative"
                            else "QA questions")
                    need[what] = max(need.get(what, 0), m.need_more)
            return "undecided: need " + ", ".join(f"{n} more {w}" for w, n in need.items())
        return PASS

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "group": self.group, "verdict": self.verdict,
                "summary": self.summary(), "need_more": self.need_more, "errors": self.errors,
                "metrics": {k: m.to_dict() for k, m in self.metrics.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Verdict":
        return cls(str(d["config"]), str(d.get("group", "")), str(d["verdict"]),
                   {str(k): MetricVerdict.from_dict(m) for k, m in
                    (d.get("metrics") or {}).items()},
                   None if d.get("need_more") is None else int(d["need_more"]),
                   int(d.get("errors", 0)))


# ---- exact bounds for retrieval -------------------------------------------------------------------
def _binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp
             + (n - i) * lq for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Exact one-sided bounds on a binomial proportion from ``k`` successes in ``n`` trials: the
    lower bound ``L`` with ``P(X >= k | L) = 1 - confidence`` (0 when ``k == 0``) and the upper
    bound ``U`` with ``P(X <= k | U) = 1 - confidence`` (1 when ``k == n``). ``n == 0`` gives
    ``(0, 1)``. Raises ``ValueError`` unless ``0 <= k <= n``."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    alpha = 1.0 - confidence
    lower = 0.0 if k == 0 else _bisect(lambda p: _binom_sf(k, n, p) - alpha)
    upper = 1.0 if k == n else _bisect(lambda p: alpha - (1.0 - _binom_sf(k + 1, n, p)))
    return lower, upper


def _bisect(f: Any, lo: float = 0.0, hi: float = 1.0, iters: int = 60) -> float:
    """The root of an increasing ``f`` on ``[lo, hi]``."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def retrieval_verdict(kept: int, dense_correct: int,
                      margin: float = RETRIEVAL_MIN_RELATIVE) -> MetricVerdict:
    """``kept`` of ``dense_correct`` tasks (the ones dense answers) kept by the configuration:
    pass when the exact lower bound of ``kept / dense_correct`` is >= ``margin``, fail when the
    upper bound is below it. ``dense_correct == 0`` says nothing (undecided, no estimate; need
    the tasks that would pass with none lost)."""
    if dense_correct == 0:
        return MetricVerdict("retrieval_relative", None, None, margin, True, 0, UNDECIDED,
                             _retrieval_need(0, 0, margin))
    lo, hi = clopper_pearson(kept, dense_correct)
    verdict = PASS if lo >= margin else FAIL if hi < margin else UNDECIDED
    need = _retrieval_need(kept, dense_correct, margin) if verdict == UNDECIDED else None
    return MetricVerdict("retrieval_relative", kept / dense_correct, (lo, hi), margin, True,
                         dense_correct, verdict, need)


def _retrieval_need(kept: int, n: int, margin: float) -> int | None:
    """More dense-correct tasks, kept at the observed rate (all kept with none observed), until
    the lower bound reaches ``margin`` (``None``: the rate is not above the margin)."""
    rate = kept / n if n else 1.0
    if rate <= margin:
        return None
    step = 1
    m = 0
    while m <= MAX_NEED:   # doubling, then bisection on the number of extra tasks
        if clopper_pearson(round(kept + rate * (m + step)), n + m + step)[0] >= margin:
            lo_m, hi_m = m, m + step
            while hi_m - lo_m > 1:
                mid = (lo_m + hi_m) // 2
                if clopper_pearson(round(kept + rate * mid), n + mid)[0] >= margin:
                    hi_m = mid
                else:
                    lo_m = mid
            return hi_m
        m += step
        step *= 2
    return None


# ---- paired bootstrap for QA ----------------------------------------------------------------------
def bootstrap_mean_interval(values: Sequence[float] | np.ndarray, seed: int = 0,
                            resamples: int = RESAMPLES,
                            confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile bootstrap of the mean of ``values`` (paired differences, one per task): the
    one-sided lower and upper ``confidence`` bounds. Seeded: the same values and seed give the
    same interval. Raises ``ValueError`` for no values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values to bootstrap")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [1.0 - confidence, confidence])
    return float(lo), float(hi)


def paired_mean_verdict(metric: str, values: Sequence[float], margin: float, seed: int = 0,
                        gates: bool = True, resamples: int = RESAMPLES) -> MetricVerdict:
    """A lower-is-better paired mean (``values``: one difference per question, config against
    dense) against ``margin``: pass when the upper bound is <= ``margin`` and there are at least
    :data:`MIN_PAIRED` values, fail when the lower bound is above it, else undecided with the
    number of questions that would shrink the interval past the margin at the observed spread."""
    x = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    n = int(x.size)
    if n == 0:
        return MetricVerdict(metric, None, None, margin, False, 0, UNDECIDED, MIN_PAIRED, gates)
    lo, hi = bootstrap_mean_interval(x, seed, resamples)
    mean = float(x.mean())
    if lo > margin:
        verdict = FAIL
    elif hi <= margin and n >= MIN_PAIRED:
        verdict = PASS
    else:
        verdict = UNDECIDED
    need = _paired_need(x, margin) if verdict == UNDECIDED else None
    return MetricVerdict(metric, mean, (lo, hi), margin, False, n, verdict, need, gates)


def _paired_need(x: np.ndarray, margin: float) -> int | None:
    """More questions until a one-sided normal bound at the observed mean and spread clears
    ``margin`` (and at least :data:`MIN_PAIRED` in all); ``None`` when the mean sits on it."""
    n = int(x.size)
    gap = abs(float(x.mean()) - margin)
    sd = float(x.std(ddof=1)) if n > 1 else 0.0
    if gap == 0.0:
        return None
    total = math.ceil((Z_ONE_SIDED * sd / gap) ** 2) if sd > 0 else 0
    total = max(total, MIN_PAIRED, n + 1)
    return total - n if total - n <= MAX_NEED else None


# ---- one configuration ----------------------------------------------------------------------------
def _paired(rows: Iterable[Mapping[str, Any]], config: str
            ) -> tuple[list[tuple[Mapping[str, Any], Mapping[str, Any]]], int]:
    """``(dense row, config row)`` per probe both answered, and the config's error count."""
    rows = list(rows)
    dense = {r["probe"]: r for r in rows if r["config"] == DENSE}
    mine = [r for r in rows if r["config"] == config]
    pairs = [(dense[r["probe"]], r) for r in mine if r["probe"] in dense]
    return pairs, sum(1 for r in mine if r.get("error"))


def _qa_diffs(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]], key: str,
              errored: float | None) -> list[float]:
    """Per QA pair ``dense[key] - config[key]`` (KL: the config's value); an errored answer counts
    as ``errored`` (``None``: left out)."""
    out: list[float] = []
    for d, c in pairs:
        if c.get("error"):
            if errored is not None:
                out.append(errored)
            continue
        cv = c.get(key)
        if cv is None:
            continue
        if key == "first_token_kl":
            out.append(float(cv))
        else:
            dv = d.get(key)
            out.append(float(dv if dv is not None else 1.0) - float(cv))
    return out


def decide(rows: Iterable[Mapping[str, Any]], config: str, seed: int = 0,
           resamples: int = RESAMPLES) -> Verdict:
    """The :class:`Verdict` of ``config`` against the ``dense`` rows among ``rows``. Retrieval
    rows are every family but ``qa``; an answer that raised counts as wrong (not kept; agreement
    0; its KL left out). Raises ``ValueError`` when ``rows`` hold no answer of ``config``."""
    pairs, errors = _paired(rows, config)
    group = next((str(c.get("group", "")) for _, c in pairs), "")
    if not pairs:
        raise ValueError(f"no answers of {config!r} paired with a dense answer")
    metrics: dict[str, MetricVerdict] = {}
    ret = [(d, c) for d, c in pairs if d.get("family") != QA_FAMILY]
    if ret:
        dense_ok = [(d, c) for d, c in ret if d.get("correct")]
        kept = sum(1 for _, c in dense_ok if c.get("correct") and not c.get("error"))
        metrics["retrieval_relative"] = retrieval_verdict(kept, len(dense_ok))
    qa = [(d, c) for d, c in pairs if d.get("family") == QA_FAMILY]
    if qa:
        for name, key, margin, errored, gates in (
                ("teacher_forced_drop", "teacher_forced", TEACHER_FORCED_MAX_DROP, 1.0, True),
                ("first_token_kl", "first_token_kl", FIRST_TOKEN_KL_MAX, None, True),
                ("greedy_drop", "greedy_agreement", GREEDY_MAX_DROP, 1.0, False)):
            diffs = _qa_diffs(qa, key, errored)
            if diffs:
                metrics[name] = paired_mean_verdict(name, diffs, margin, seed, gates, resamples)
    return combine(config, group, metrics, errors)


def combine(config: str, group: str, metrics: Mapping[str, MetricVerdict],
            errors: int = 0) -> Verdict:
    """The configuration's verdict from its metrics: fail when any fails; pass when every gating
    metric passes (at least one measured); else undecided with the most any undecided gating
    metric needs."""
    gating = [m for m in metrics.values() if m.gates]
    if any(m.verdict == FAIL for m in metrics.values()):
        return Verdict(config, group, FAIL, dict(metrics), None, errors)
    if gating and all(m.verdict == PASS for m in gating):
        return Verdict(config, group, PASS, dict(metrics), None, errors)
    needs = [m.need_more for m in gating if m.verdict == UNDECIDED]
    known = [x for x in needs if x is not None]
    need = max(known) if needs and len(known) == len(needs) else None
    return Verdict(config, group, UNDECIDED, dict(metrics), need, errors)


def decide_all(rows: Sequence[Mapping[str, Any]], seed: int = 0,
               resamples: int = RESAMPLES) -> dict[str, Verdict]:
    """:func:`decide` for every configuration in ``rows`` but ``dense``, in order of appearance
    (configurations with no answer paired with dense are left out)."""
    names = list(dict.fromkeys(str(r["config"]) for r in rows if r["config"] != DENSE))
    dense = {r["probe"] for r in rows if r["config"] == DENSE}
    return {c: decide(rows, c, seed, resamples) for c in names
            if any(r["config"] == c and r["probe"] in dense for r in rows)}


def _opt(x: Any) -> float | None:
    return None if x is None else float(x)
