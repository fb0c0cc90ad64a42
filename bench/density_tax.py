"""What recording LLMS's density costs a call (sparkv/device/density.py): one ``ContextService``
in process with SmolLM2 and a kept context of the bundled story's first tokens; each call made
twice, density recorded (``on``, the service as it runs) and not (``off``: the hook left idle,
what a call would cost without LLMS's levels), alternating, each in its own turn scope (no call
reuses the other's turn). Three kinds of call:

* ``kept``: a question asked again in its scope (its turn's KV reused: one row runs), 1 token;
* ``question``: a new question, 1 token (the question's rows run);
* ``answer``: a new question and a ``--answer``-token answer (every token's rows).

    python bench/density_tax.py [--rounds 5] [--tokens 2048] [--answer 32] [--defer]
                                [--out bench/results/density_tax_cpu.json]

Per kind the median call time and first token, on and off, and the ratio on / off: the tax.
Timed inside the ``on`` calls: the seconds the recording's end spent summing its waiting rows
(``DensityRecorder.flush``: the part of the tax paid after the last token, and any early sums
of a long answer); the seconds the density's hook took (every attention module's, every pass:
what a decoded token pays while it runs, the flush aside); the seconds the column sums of a
fork's attention weights took (inside the attention, before the hook: what a pass pays for
taking them); and the call's write-ahead (``aot_s``: once the densities move a context's
levels, the chunks that changed are written after the answer). ``--defer`` adds a third mode
in the same run: density on, no weights taken (every pass summed by the hook, as before the
column sink).
Run it on two checkouts to compare. SmolLM2 (the bundled model), greedy, answers run to their
length, 2 torch threads; wall clock on whatever machine runs it. No paper figure (LLMS does not
report what measuring its densities costs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Iterator

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402

KINDS = ("kept", "question", "answer")
#: the seconds each call of the density's attention hook took, its flushes left out
#: (:func:`timed_hooks`)
HOOK_SPENT: list[float] = []
#: the seconds each flush took (:func:`timed_flush`)
FLUSH_SPENT: list[float] = []
#: the seconds each column sum of a fork's attention weights took, inside the attention
#: (:func:`timed_weights`; none on a checkout without the column sink)
WEIGHTS_SPENT: list[float] = []


@contextlib.contextmanager
def density_mode(mode: str) -> Iterator[None]:
    """The service's calls record no density in mode ``off``, and take no attention weights in
    mode ``defer`` (``DensityRecorder.TAKE_WEIGHTS`` off: every pass summed by the hook)."""
    from sparkv.device import calls, density

    if mode == "defer":
        take = getattr(density.DensityRecorder, "TAKE_WEIGHTS", False)
        density.DensityRecorder.TAKE_WEIGHTS = False
        try:
            yield
        finally:
            density.DensityRecorder.TAKE_WEIGHTS = take
        return
    if mode != "off":
        yield
        return
    calls.recording = lambda rec: density.recording(None)  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        calls.recording = density.recording                     # type: ignore[misc]


@contextlib.contextmanager
def timed_flush() -> Iterator[list[float]]:
    """The seconds each ``DensityRecorder.flush`` takes meanwhile (appended to the list)."""
    from sparkv.device.density import DensityRecorder

    spent = FLUSH_SPENT
    spent.clear()
    plain = DensityRecorder.flush

    def flush(self: Any) -> None:
        t = time.perf_counter()
        try:
            plain(self)
        finally:
            spent.append(time.perf_counter() - t)

    DensityRecorder.flush = flush                                 # type: ignore[method-assign]
    try:
        yield spent
    finally:
        DensityRecorder.flush = plain                             # type: ignore[method-assign]


def timed_hooks() -> None:
    """Times every call of the density's attention hook into :data:`HOOK_SPENT` (before the
    service installs it)."""
    from sparkv.device import density
    from sparkv.runtime.hooks import rows_safe

    plain = density._attention_hook

    @rows_safe
    def hook(*args: Any, **kwargs: Any) -> None:
        t, flushes = time.perf_counter(), len(FLUSH_SPENT)
        try:
            plain(*args, **kwargs)
        finally:
            HOOK_SPENT.append(time.perf_counter() - t - sum(FLUSH_SPENT[flushes:]))

    density._attention_hook = hook


def timed_weights() -> None:
    """Times every column sum the recording thread's sink makes of a fork's attention weights
    into :data:`WEIGHTS_SPENT` (the sink is looked up when a recording starts)."""
    from sparkv.device import density

    name = next((n for n in ("_offered_sums", "_offered_weights") if hasattr(density, n)), None)
    if name is None:
        return
    plain = getattr(density, name)

    def sink(*args: Any) -> None:
        t = time.perf_counter()
        try:
            plain(*args)
        finally:
            WEIGHTS_SPENT.append(time.perf_counter() - t)

    setattr(density, name, sink)


def one_call(svc: Any, cid: str, question: str, tokens: int, scope: str,
             mode: str) -> dict[str, float]:
    HOOK_SPENT.clear()
    WEIGHTS_SPENT.clear()
    with density_mode(mode), timed_flush() as spent:
        res = svc.call(cid, question, max_new_tokens=tokens, grow=False, stop_at_eos=False,
                       turn_scope=scope)
    return {"total_s": res.total_s, "first_token_s": res.first_token_s, "flush_s": sum(spent),
            "hook_s": sum(HOOK_SPENT), "weights_s": sum(WEIGHTS_SPENT), "aot_s": res.aot_s}


def one_round(svc: Any, cid: str, r: int, questions: list[str], answer: int,
              modes: tuple[str, ...]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {k: {} for k in KINDS}
    order = modes[r % len(modes):] + modes[:r % len(modes)]
    q_new, q_answer = questions[(2 * r) % len(questions)], questions[(2 * r + 1) % len(questions)]
    for mode in order:
        scope = f"{mode}-{r}"
        out["question"][mode] = one_call(svc, cid, q_new, 1, scope, mode)
        out["kept"][mode] = one_call(svc, cid, q_new, 1, scope, mode)
        out["answer"][mode] = one_call(svc, cid, q_answer, answer, scope, mode)
    return out


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        row: dict[str, float] = {}
        for mode in rounds[0][kind]:
            for key in ("total_s", "first_token_s"):
                row[f"{key}_{mode}"] = round(statistics.median(
                    r[kind][mode][key] for r in rounds), 4)
        for key in ("flush_s", "hook_s", "weights_s", "aot_s"):
            row[f"{key}_on"] = round(statistics.median(r[kind]["on"][key] for r in rounds), 4)
        row["tax"] = round(row["total_s_on"] / row["total_s_off"], 3)
        row["first_token_tax"] = round(row["first_token_s_on"] / row["first_token_s_off"], 3)
        if "total_s_defer" in row:            # the weights taken against every pass summed
            row["on_vs_defer"] = round(row["total_s_on"] / row["total_s_defer"], 3)
            row["first_token_on_vs_defer"] = round(
                row["first_token_s_on"] / row["first_token_s_defer"], 3)
        table[kind] = row
    return table


def main() -> int:
    from sparkv.device import ContextService
    from sparkv.runtime.heap import freeze_heap, keep_freed_memory

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=2048, help="the context's tokens")
    p.add_argument("--answer", type=int, default=32, help="an answer's tokens")
    p.add_argument("--out", default=None)
    p.add_argument("--defer", action="store_true",
                   help="also a third mode: density on, no attention weights taken")
    a = p.parse_args()
    timed_hooks()
    timed_weights()
    lm, qa, ids = story_model(a.tokens)
    questions = [item.question for item in qa.items]
    rounds = []
    with tempfile.TemporaryDirectory() as d:
        svc = ContextService(lm, 1 << 31, d)
        cid = svc.new_context(system_ids=ids)
        svc.call(cid, "Hi.", max_new_tokens=2, grow=False)          # warm
        keep_freed_memory()               # as the service's process does: the C heap's
        freeze_heap()                     # thresholds fixed, no full collection
        for r in range(a.rounds):
            modes = ("on", "off", "defer") if a.defer else ("on", "off")
            rounds.append(one_round(svc, cid, r, questions, a.answer, modes))
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(
                f"{k} {rounds[-1][k]['on']['total_s']:.3f}/{rounds[-1][k]['off']['total_s']:.3f}"
                " s" for k in KINDS), flush=True)
        svc.close()
    table = summary(rounds)
    print(f"\n{len(ids)}-token context, medians of {a.rounds} (on / off)")
    print("| call | call time | tax | first token | tax | flush | hooks | weights | write-ahead |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for kind, row in table.items():
        print(f"| {kind} | {row['total_s_on']:.3f} / {row['total_s_off']:.3f} s | "
              f"{row['tax']:.2f}x | {row['first_token_s_on']:.3f} / "
              f"{row['first_token_s_off']:.3f} s | {row['first_token_tax']:.2f}x | "
              f"{row['flush_s_on']:.3f} s | {row['hook_s_on']:.3f} s | "
              f"{row['weights_s_on']:.4f} s | {row['aot_s_on']:.3f} s |")
    if a.defer:
        print("\ndensity on, weights taken / every pass summed by the hook (defer)\n"
              "| call | call time | ratio | first token | ratio |\n|---|---|---|---|---|")
        for kind, row in table.items():
            print(f"| {kind} | {row['total_s_on']:.3f} / {row['total_s_defer']:.3f} s | "
                  f"{row['on_vs_defer']:.2f}x | {row['first_token_s_on']:.3f} / "
                  f"{row['first_token_s_defer']:.3f} s | {row['first_token_on_vs_defer']:.2f}x |")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "context_tokens": len(ids), "rounds": rounds, "median": table},
            indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
