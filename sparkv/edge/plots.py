"""Pictures of the edge's runs: the two paths on a timeline, and TTFT per strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

_COLORS = {"sparkv": "#d62728", "local": "#1f77b4", "stream": "#2ca02c", "hybrid": "#9467bd",
           "reference": "#7f7f7f"}


def plot_timelines(runs: Sequence[tuple[str, Any]], path: str | Path, title: str = "") -> Path:
    """One panel per run: compute steps (top lane) and transfers (bottom lane) over time.

    ``runs``: ``(label, AskResult)`` pairs. Colours: layer index for steps, level for transfers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(10, 1.4 + 1.1 * n), sharex=True, squeeze=False)
    lv_col = {"raw": "#444444", "q8": "#2ca02c", "q6": "#17becf", "q5": "#1f77b4",
              "q4": "#ff7f0e", "q3": "#d62728", "q2": "#8c564b"}
    xmax = 0.0
    for ax, (label, res) in zip(axes[:, 0], runs):
        load = res.load
        offset = res.breakdown.manifest_s + res.breakdown.planning_s
        L = res.instance.L if res.instance is not None else 1
        if load is not None:
            for s, (a, b) in load.steps.items():
                ax.broken_barh([(offset + a, max(b - a, 1e-3))], (1.05, 0.8),
                               color=plt.cm.viridis(s.l / max(L - 1, 1)), linewidth=0)
            for x in load.transfers:
                if x.first_byte_s == x.first_byte_s and x.end_s == x.end_s:
                    ax.broken_barh([(offset + x.first_byte_s, max(x.end_s - x.first_byte_s, 1e-3))],
                                   (0.1, 0.8), color=lv_col.get(x.level, "black"), linewidth=0,
                                   alpha=0.5 if x.status != "arrived" else 1.0)
        ttft = res.breakdown.ttft_s
        xmax = max(xmax, ttft)
        ax.axvline(ttft, color="red", linewidth=1.2)
        ax.text(ttft, 1.9, f" TTFT {ttft:.2f} s", color="red", va="top", fontsize=8)
        ax.set_yticks([0.5, 1.45])
        ax.set_yticklabels(["link", "compute"], fontsize=8)
        ax.set_ylim(0, 2.0)
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the question (compute: colour = layer; link: colour = "
                           "level, grey = raw)")
    axes[-1, 0].set_xlim(0, xmax * 1.08 + 0.05)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_vs_bandwidth(rows: Sequence[Mapping[str, Any]], path: str | Path,
                           title: str = "") -> Path:
    """TTFT (median, with min-max spread) against constant bandwidth, one panel per context size.

    ``rows``: dicts with ``tokens``, ``link`` (a number for constant links), ``strategy``,
    ``ttft_median_s``, ``ttft_min_s``, ``ttft_max_s``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
