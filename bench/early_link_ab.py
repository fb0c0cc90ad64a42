"""The link started by the plan's thread (sparkv.edge.session ``EdgeSession._begin``) against
the link started once the prelude's span in progress is done, paired in one process
(docs/edge.md, "The start-up overlap").

Each variant (``early``: as shipped; ``late``: ``_begin`` returns ``None``; ``tax``: early,
planned with the learned receive tax; ``pool``: early, frames decoded by a worker thread, not in
turn; ``noprelude``: no prelude; ``nopre``: early, the load's first connection not opened at the ask's start, and
``hybrid-nopre`` Strong Hybrid so; ``nohandover``: early, the load waits for the portfolio's
full plan instead of starting by its first and taking the full one when ready; ``firstonly``:
the load keeps the portfolio's first plan, the structured split; ``nodit``: the plan prices
the frames' decoding as free, as before session 76, and ``hybrid-nodit`` Strong Hybrid so;
``known``: early, planned with the link's true rate, not the first ask's default prior (constant
links only), and ``hybrid-known`` Strong Hybrid so; ``noreplan``: early, no re-plan at the
link's measured rate (docs/scheduler.md, "A re-plan at the measured rate"), and
``hybrid-noreplan`` Strong Hybrid so; ``oldrtt``: early, the plan's round trip read when the
first read's bytes were in, as before session 81, not when its first byte crossed the link
(docs/edge.md, "Priors: one estimator"), and ``hybrid-oldrtt`` Strong Hybrid so),
hybrid and local
in turn per link, the order reversed every other link (SmolLM2 2K, T=512, raw/q8/q5, a fresh
prior each ask); sparkv / local and sparkv / hybrid per link and over all.

    python bench/early_link_ab.py --links 100mbps,200mbps,wifi,lte,50mbps,20mbps --rounds 3 \\
        --out bench/results/early_link_ab_s73.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics as st
from typing import Any

from sparkv.cli import passive_openmp_waits

passive_openmp_waits()          # before torch loads, as the sparkv command does

from sparkv.edge import session  # noqa: E402
from sparkv.edge.client import EdgeClient  # noqa: E402
from sparkv.edge.commands import read_trace  # noqa: E402
from sparkv.edge.engine import EngineConfig  # noqa: E402
from sparkv.edge.session import EdgeSession  # noqa: E402
from sparkv.bench.served import fresh_ask, netns_served_context, served_context  # noqa: E402
from sparkv.predictor.dtypes import load_model_in_dtype  # noqa: E402
from sparkv.runtime.heap import settle  # noqa: E402
from sparkv.scheduler.trace import Trace  # noqa: E402

VARIANTS = ("early", "late", "hybrid", "local")
#: variants besides those (``--variants``): sparkv asks with these options
EXTRA: dict[str, dict[str, Any]] = {
    "tax": {"plan_receive_tax": True},
    "pool": {"engine_config": EngineConfig(decode_in_turn=False)},   # a decode worker thread
    "noprelude": {"prelude": False},   # the load starts from nothing computed
}
EARLY = {"on": True}               # whether the next sparkv ask starts its link early
PRECONNECT = {"on": True}          # whether the next ask opens its load's connection ahead
HANDOVER = {"on": True}            # whether the next load starts by the planner's first plan
FULL = {"on": True}                # whether the full plan is handed over to it
IN_TURN = {"on": True}             # whether the plan knows its frames are decoded in turn
REPLAN = {"on": True}              # whether the load may re-plan at the measured link rate
FIRST_BYTE = {"on": True}          # whether the plan's RTT is the first byte's, not first read's


def _toggled(owner: Any, name: str, flag: dict[str, bool]) -> None:
    """``owner.name`` runs as before while ``flag["on"]``, and returns ``None`` otherwise."""
    wrapped = getattr(owner, name)

    def maybe(*a: Any, **k: Any) -> Any:
        return wrapped(*a, **k) if flag["on"] else None

    setattr(owner, name, maybe)


def _first_read_rtt() -> None:
    """While ``FIRST_BYTE`` is off, the client's round trip is its last shaped request's first
    read's time (before session 81)."""
    request = EdgeClient._request

    def timed(self: EdgeClient, *a: Any, **k: Any) -> Any:
        fetched = request(self, *a, **k)
        if not FIRST_BYTE["on"] and k.get("shaped", True):
            self.last_first_byte_s = fetched.first_read_s
        return fetched

    setattr(EdgeClient, "_request", timed)


def _patch() -> None:
    _first_read_rtt()
    _toggled(session.EdgeSession, "_begin", EARLY)
    _toggled(EdgeClient, "preconnect", PRECONNECT)
    _toggled(session, "_first_plan", HANDOVER)
    _toggled(session.EdgeSession, "_hand_over", FULL)
    _toggled(session.EdgeSession, "_decodes_in_turn", IN_TURN)
    _toggled(session, "replanner", REPLAN)


def _trace(name: str) -> Trace:
    return Trace.constant(float(name[:-4])) if name.endswith("mbps") else read_trace(name)


def _simulated(r: Any, b: Any, link: str, strategy: str) -> float | None:
    """The simulator's TTFT for the load the ask ran, under its controller and link, with the
    ask's manifest and planning time (``sparkv bench ttft``'s ``sim_ttft_s``)."""
    from sparkv.bench.ttft import simulated_load_s

    if r.plan is None or r.instance is None or r.controller is None:
        return None
    return b.manifest_s + b.planning_s + simulated_load_s(
        r, strategy, r.controller, _trace(link), r.instance.replace(rtt_s=0.02))


def _ratios(res: dict, links: list[str], name: str, ref: str) -> list[float]:
    return [a / b for ln in links for a, b in zip(res[(ln, name)], res[(ln, ref)])]


def _options(name: str, link: str) -> dict[str, Any]:
    """The ask options of variant ``name`` on ``link`` (``known``: the link's rate as the plan's
    prior, where a fresh ask plans with the default 50 Mbit/s)."""
    if name.endswith("known"):
        return {"bandwidth_mbps": float(link[:-4])}
    return EXTRA.get(name, {})


def ttft_pairs(s: EdgeSession, cid: str, links: list[str], rounds: int,
               variants: tuple[str, ...] = VARIANTS, shaped: Any = None) -> tuple[list, dict]:
    rows: list[dict] = []
    res: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    k = 0
    for rnd in range(rounds):
        for ln in links:
            k += 1
            for name in (variants if k % 2 else variants[::-1]):
                EARLY["on"] = name != "late"
                PRECONNECT["on"] = not name.endswith("nopre")
                HANDOVER["on"] = name != "nohandover"
                FULL["on"] = name != "firstonly"
                IN_TURN["on"] = not name.endswith("nodit")
                REPLAN["on"] = not name.endswith("noreplan")
                FIRST_BYTE["on"] = not name.endswith("oldrtt")
                strategy = (name.split("-")[0] if name.startswith(("hybrid", "local"))
                            else "sparkv")
                r = fresh_ask(s, cid, strategy, _trace(ln), link=shaped, **_options(name, ln))
                b = r.breakdown
                info = r.plan.info if r.plan is not None else {}
                res[(ln, name)].append(b.ttft_s)
                rows.append(dict(link=ln, round=rnd, variant=name, ttft_s=b.ttft_s,
                                 rtt_ms=r.instance.rtt_s * 1e3 if r.instance else None,
                                 loading_s=b.loading_s, planning_s=b.planning_s,
                                 manifest_s=b.manifest_s, chunks_streamed=b.chunks_streamed,
                                 decoding_s=b.decoding_s, compute_s=b.local_compute_s,
                                 sim_ttft_s=_simulated(r, b, ln, strategy),
                                 handover=info.get("handover"), replan=info.get("replan")))
                print(f"{ln:9s} {name:6s} ttft {b.ttft_s:.3f} streamed {b.chunks_streamed}"
                      + (" replanned" if info.get("replan") else ""), flush=True)
    out: dict[str, Any] = {}
    mine = [nm for nm in variants if nm not in ("hybrid", "local")]   # hybrid-nopre too
    for ref in [r for r in ("local", "hybrid") if r in variants]:
        per_link = {ln: {nm: st.median(_ratios(res, [ln], nm, ref)) for nm in mine}
                    for ln in links}
        summary = {nm: {"median": st.median(v), "max": max(v), "mean": st.mean(v)}
                   for nm in mine for v in [_ratios(res, links, nm, ref)]}
        out[f"over_{ref}"] = {"per_link": per_link, "summary": summary}
    return rows, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", default="100mbps,200mbps,wifi,lte,50mbps,20mbps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048, help="the context's length")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"of {VARIANTS + tuple(EXTRA)}, nopre, nohandover, firstonly, nodit, "
                         "known, noreplan, oldrtt (and hybrid-nopre, hybrid-nodit, "
                         "hybrid-known, hybrid-noreplan, hybrid-oldrtt); hybrid and local are "
                         "the references")
    ap.add_argument("--netns", action="store_true",
                    help="the server in a network namespace, tc shaping a real veth path (root "
                         "only, docs/netns.md; no RTT added: this kernel has no netem)")
    ap.add_argument("--out", default="bench/results/early_link_ab.json")
    args = ap.parse_args()
    links, variants = args.links.split(","), tuple(args.variants.split(","))
    if any(v.endswith("known") for v in variants) and not all(ln.endswith("mbps") for ln in links):
        ap.error("the known variants need constant links (NNmbps)")
    _patch()
    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    settle()
    if args.netns:
        with netns_served_context(lm, tokens=args.tokens) as (s, cid, link):
            rows, ttft = ttft_pairs(s, cid, links, args.rounds, variants, link)
    else:
        with served_context(lm, tokens=args.tokens) as (s, cid):
            rows, ttft = ttft_pairs(s, cid, links, args.rounds, variants)
    print(json.dumps(ttft, indent=1))
    with open(args.out, "w") as f:
        json.dump({"ttft": ttft, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
