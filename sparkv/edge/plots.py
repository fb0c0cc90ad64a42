"""Pictures of the edge's runs: the two paths on a timeline, and TTFT per strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

_LEVEL_COLORS = {"raw": "#444444", "q8": "#2ca02c", "q6": "#17becf", "q5": "#1f77b4",
                 "q4": "#ff7f0e", "q3": "#d62728", "q2": "#8c564b"}
_COLORS = {"sparkv": "#d62728", "local": "#1f77b4", "stream": "#2ca02c", "hybrid": "#9467bd",
           "reference": "#7f7f7f"}


def timeline_of(res: Any) -> dict[str, Any]:
    """The JSON timeline of one :class:`~sparkv.edge.session.AskResult` (what the plots draw):
    ``offset_s`` (manifest + planning), ``ttft_s``, ``steps`` ``[t, l, start, end]``,
    ``transfers`` ``[t, l, g, level, bytes, requested, first_byte, end, decoded, status]``,
    ``migrations``; loading times are relative to the start of loading."""
    load = res.load
    return {"offset_s": res.breakdown.manifest_s + res.breakdown.planning_s,
            "ttft_s": res.breakdown.ttft_s, **(load.timeline() if load is not None else {})}


def _save(fig: Any, path: str | Path) -> Path:
    from sparkv.extras import pyplot

    plt = pyplot()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timelines(runs: Sequence[tuple[str, Mapping[str, Any]]], path: str | Path,
                   title: str = "") -> Path:
    """One panel per run: compute steps (top lane, colour = layer) and transfers (bottom lane,
    colour = level; faded = not used) on one time axis from the question; a red line at TTFT.

    ``runs``: ``(label, timeline)`` pairs, timelines as made by :func:`timeline_of`.
    """
    from sparkv.extras import pyplot

    plt = pyplot()

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.4 + 1.1 * len(runs)), sharex=True,
                             squeeze=False)
    xmax = 0.0
    for ax, (label, tl) in zip(axes[:, 0], runs):
        off = float(tl.get("offset_s", 0.0))
        steps = tl.get("steps", [])
        layers = max([x[1] for x in steps] or [1])
        for _t, layer, a, b in steps:
            ax.broken_barh([(off + a, max(b - a, 1e-3))], (1.05, 0.8),
                           color=plt.cm.viridis(layer / max(layers, 1)), linewidth=0)
        for x in tl.get("transfers", []):
            first, end, status = x[6], x[7], x[9]
            if first == first and end == end:   # not NaN
                ax.broken_barh([(off + first, max(end - first, 1e-3))], (0.1, 0.8),
                               color=_LEVEL_COLORS.get(x[3], "black"), linewidth=0,
                               alpha=1.0 if status == "arrived" else 0.4)
        ttft = float(tl["ttft_s"])
        xmax = max(xmax, ttft)
        ax.axvline(ttft, color="red", linewidth=1.2)
        ax.text(ttft, 1.9, f" TTFT {ttft:.2f} s", color="red", va="top", fontsize=8)
        ax.set_yticks([0.5, 1.45])
        ax.set_yticklabels(["link", "compute"], fontsize=8)
        ax.set_ylim(0, 2.0)
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the question (compute: colour = layer; link: colour = "
                           "level, grey = raw, green = q8, blue = q5)")
    axes[-1, 0].set_xlim(0, xmax * 1.08 + 0.05)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_ttft_vs_bandwidth(rows: Sequence[Mapping[str, Any]], path: str | Path,
                           title: str = "") -> Path:
    """TTFT (median, with min-max spread) against constant bandwidth, one panel per context size.

    ``rows``: dicts with ``tokens``, ``link`` (a number for constant links), ``strategy``,
    ``ttft_median_s``, ``ttft_min_s``, ``ttft_max_s``.
    """
    from sparkv.extras import pyplot

    plt = pyplot()

    sizes = sorted({int(r["tokens"]) for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.6), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for strat in ("local", "stream", "hybrid", "sparkv"):
            pts = sorted((float(r["link"]), r) for r in rows if int(r["tokens"]) == n
                         and r["strategy"] == strat and isinstance(r["link"], (int, float)))
            if not pts:
                continue
            x = [p[0] for p in pts]
            y = [p[1]["ttft_median_s"] for p in pts]
            lo = [p[1]["ttft_median_s"] - p[1]["ttft_min_s"] for p in pts]
            hi = [p[1]["ttft_max_s"] - p[1]["ttft_median_s"] for p in pts]
            ax.errorbar(x, y, yerr=[lo, hi], label=strat, color=_COLORS.get(strat), marker="o",
                        markersize=3, capsize=2, linewidth=1.2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link (Mbit/s)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{n} tokens", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)
