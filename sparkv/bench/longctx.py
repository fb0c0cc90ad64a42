"""Long contexts in ``sparkv bench ttft``: which model a sweep past the model's window runs, and
how TTFT grows with the context.

* :func:`long_context_model`: the model spec of a sweep under ``--long-context`` (``auto``: the
  RoPE-extended model, :mod:`sparkv.runtime.longctx`, when the largest size exceeds the model's
  window; ``rope`` always; ``random`` random weights of the same shape, extended; ``off`` never).
  One model for every size of the sweep, so that its sizes compare.
* :func:`growth_report`: each strategy's TTFT per context token at the largest size over its
  value at the base size (4096 tokens when swept), per constant link, with the LP bound's growth
  beside it; target for sparkv <= 1.3x (issue 28). :func:`plot_growth` draws it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

LONG_CONTEXT_MODES = ("auto", "rope", "random", "off")
GROWTH_TARGET = 1.3
GROWTH_BASE_TOKENS = 4096
GROWTH_STRATEGIES = ("local", "stream", "hybrid", "sparkv")
#: the model whose random-weight twin ``--long-context random`` builds when no --model is given
DEFAULT_RANDOM_SHAPE = "random:smollm2-135m"


class LongContextError(ValueError):
    """A ``--long-context`` choice that cannot apply to this model or these sizes."""


def extended_positions(native: int, largest: int) -> int:
    """The extended window: ``largest`` rounded up to a whole multiple of the native window, at
    least twice it."""
    return native * max(2, math.ceil(largest / native))


def long_context_model(model: str | None, native: int, sizes: Sequence[int],
                       mode: str = "auto") -> str | None:
    """The model spec the sweep runs (``model`` itself when no long mode applies).

    Args:
        model: ``--model`` (``None``: the bundled SmolLM2).
        native: the model's window (``LoadedModel.native_positions``).
        sizes: the context sizes swept (tokens).
        mode: one of :data:`LONG_CONTEXT_MODES`.

    Raises:
        LongContextError: an unknown mode; ``off`` with a size past the window; ``random`` for
            a checkpoint (random weights exist only for the shapes of ``random:``).
    """
    from sparkv.runtime.longctx import is_long_spec, long_context_spec
    from sparkv.runtime.shapes import is_random_spec

    if mode not in LONG_CONTEXT_MODES:
        raise LongContextError(f"--long-context {mode!r}: choose one of {LONG_CONTEXT_MODES}")
    largest = max(sizes)
    if is_long_spec(model) or mode == "off" or (mode == "auto" and largest <= native):
        if largest > native and not is_long_spec(model):
            raise LongContextError(
                f"{largest} tokens exceed the model's {native} positions: use --long-context "
                "auto or rope (RoPE extended, timing only past the window)")
        return model
    base = model
    if mode == "random" and not is_random_spec(model):
        if model is not None:
            raise LongContextError("--long-context random needs the bundled model or a "
                                   "--model random:SHAPE (random weights of a known shape)")
        base = DEFAULT_RANDOM_SHAPE
    return long_context_spec(extended_positions(native, largest), base)


def _per_token(by: dict[tuple[int, Any, str], float], n: int, link: Any, key: str
               ) -> float | None:
    v = by.get((n, link, key))
    return v / n if v else None


def growth_report(points: Sequence[dict[str, Any]], sizes: Sequence[int],
                  links: Sequence[Any]) -> dict[str, Any] | None:
    """TTFT per context token at the largest size over its value at the base size, per
    constant link and strategy (``lp_bound`` too); ``None`` with fewer than two sizes.

    ``points``: ``bench ttft``'s points (``tokens``, ``link``, ``strategy``, ``ttft_median_s``,
    ``lp_bound_s``); ``links``: the link labels, numbers for constant links."""
    sizes = sorted(set(sizes))
    if len(sizes) < 2:
        return None
    base = GROWTH_BASE_TOKENS if GROWTH_BASE_TOKENS in sizes[:-1] else sizes[0]
    top = sizes[-1]
    by = {(p["tokens"], p["link"], p["strategy"]): p["ttft_median_s"] for p in points}
    for p in points:
        if p.get("lp_bound_s"):
            by[(p["tokens"], p["link"], "lp_bound")] = p["lp_bound_s"]
    rows = []
    for link in [lab for lab in links if isinstance(lab, (int, float))]:
        row: dict[str, Any] = {"link": link}
        for key in (*GROWTH_STRATEGIES, "lp_bound"):
            lo, hi = _per_token(by, base, link, key), _per_token(by, top, link, key)
            row[f"{key}_ms_per_token"] = {str(base): _ms(lo), str(top): _ms(hi)}
            row[key] = hi / lo if lo and hi else None
        row["met"] = None if row["sparkv"] is None else bool(row["sparkv"] <= GROWTH_TARGET)
        rows.append(row)
    return {"base_tokens": base, "top_tokens": top, "target": GROWTH_TARGET,
            "measure": f"(TTFT / tokens at {top}) / (TTFT / tokens at {base})", "per_link": rows}


def _ms(seconds_per_token: float | None) -> float | None:
    return None if seconds_per_token is None else seconds_per_token * 1e3


def growth_lines(growth: dict[str, Any]) -> list[str]:
    """The report as text, one line per link."""
    out = []
    for r in growth["per_link"]:
        parts = [f"{k} {r[k]:.2f}x" for k in (*GROWTH_STRATEGIES, "lp_bound")
                 if r.get(k) is not None]
        out.append(f"growth of TTFT per token, {growth['top_tokens']} vs {growth['base_tokens']} "
                   f"tokens at {r['link']} Mbit/s: " + ", ".join(parts)
                   + f" (target sparkv <= {growth['target']}: "
                   + ("n/a" if r["met"] is None else "met" if r["met"] else "MISSED") + ")")
    return out


def plot_growth(points: Sequence[dict[str, Any]], growth: dict[str, Any], path: Path,
                label: str) -> None:
    """TTFT per 1K context tokens against the context size, one panel per constant link of the
    report: every strategy, and the LP bound dashed."""
    from sparkv.extras import pyplot

    plt = pyplot()
    links = [r["link"] for r in growth["per_link"]]
    if not links:
        return
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        pts = [p for p in points if p["link"] == link]
        for key in (*GROWTH_STRATEGIES, "lp_bound"):
            xy = sorted((p["tokens"], (p["ttft_median_s"] if key != "lp_bound"
                                       else p.get("lp_bound_s")))
                        for p in pts if p["strategy"] == (key if key != "lp_bound" else "sparkv"))
            xy = [(n, v / n * 1e3) for n, v in xy if v]
            if xy:
                ax.plot(*zip(*xy), marker="o", label=key.replace("_", " "),
                        ls="--" if key == "lp_bound" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("TTFT per 1K context tokens (s)")
        ax.set_title(f"{link} Mbit/s", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"TTFT growth ({growth['top_tokens']} vs {growth['base_tokens']} tokens; "
                 f"target sparkv <= {growth['target']}x)\n{label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
