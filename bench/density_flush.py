"""What summing a call's waiting density rows costs (``sparkv/device/density.py``,
``_column_mass``), this checkout against another, on the rows of real calls.

One ``ContextService`` with SmolLM2 and a kept context of the bundled story's first tokens
answers a question with a ``--answer``-token answer and a new question with one token; the rows
each call's recording sums at its end (queries, keys, positions) are captured, and those the
context's system prompt summed layer by layer as its prefill ran (``prefill``) by a process of
their own; the timing process holds nothing else. Then each
checkout's ``_column_mass`` sums them ``--reps`` times, the two alternating, and the fastest
time of each is kept (this machine's noise only ever adds time). Both must give the same sums.

    python bench/density_flush.py [--against DIR] [--reps 40] [--tokens 2048] [--answer 32]
                                  [--out bench/results/density_flush_cpu.json]

``DIR`` is another checkout's root (e.g. a ``git worktree`` of the commit before). SmolLM2,
2 torch threads, the C heap kept as the service's process keeps it (``keep_freed_memory``),
wall clock on whatever machine runs it. This VM has slow spells (seen for up to a minute after
a model's process ends, not always): every sum then takes ~1.6x as long, either checkout; run it
twice, the ratio of one run holds only if both its times are the usual ones. No paper figure
(LLMS does not report what measuring its densities costs); ``bench/density_tax.py`` shows the
whole call's tax.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402

Rows = tuple[torch.Tensor, list[list[torch.Tensor]], torch.Tensor, int]


def captured_rows(tokens: int, answer: int) -> list[tuple[str, list[Rows]]]:
    """The rows each recording sums: a new context's (its system prompt's prefill, summed layer
    by layer as the pass runs), and an answer's and a question's (summed at the call's end)."""
    from sparkv.device import ContextService
    from sparkv.device import density

    got: list[Rows] = []
    plain = density._column_mass

    def keep(q: torch.Tensor, parts: list[list[torch.Tensor]], pos: torch.Tensor,
             s: int) -> torch.Tensor:
        got.append((q.clone(), [[p.clone() for p in ps] for ps in parts], pos.clone(), s))
        return plain(q, parts, pos, s)

    lm, qa, ids = story_model(tokens)
    out = []
    density._column_mass = keep                                   # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as d:
            svc = ContextService(lm, 1 << 31, d)
            cid = svc.new_context(system_ids=ids)
            out.append(("prefill", list(got)))
            for kind, item, n in (("answer", 0, answer), ("question", 1, 1)):
                got.clear()
                svc.call(cid, qa.items[item].question, max_new_tokens=n, grow=False,
                         stop_at_eos=False, turn_scope=kind)
                out.append((kind, list(got)))
            svc.close()
    finally:
        density._column_mass = plain
    return out


def captured_in_child(tokens: int, answer: int) -> list[tuple[str, list[Rows]]]:
    """:func:`captured_rows` run by a process of its own (this script's ``--capture``)."""
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "rows.pt"
        subprocess.run([sys.executable, __file__, "--capture", str(path), "--tokens",
                        str(tokens), "--answer", str(answer)], check=True)
        got: list[tuple[str, list[Rows]]] = torch.load(path)
    return got


def other_density(root: str) -> ModuleType:
    """``sparkv/device/density.py`` of the checkout at ``root``, as its own module."""
    name = "density_against"
    spec = importlib.util.spec_from_file_location(
        name, pathlib.Path(root) / "sparkv" / "device" / "density.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def fastest(mods: dict[str, ModuleType], sums: list[Rows], reps: int) -> dict[str, float]:
    """Per module, the fastest of ``reps`` times it made every sum of ``sums``, the modules
    alternating."""
    best = {name: float("inf") for name in mods}
    for r in range(reps):
        order = list(mods.items()) if r % 2 == 0 else list(reversed(mods.items()))
        for name, mod in order:
            t = time.perf_counter()
            for rows in sums:
                mod._column_mass(*rows)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def main() -> int:
    from sparkv.device import density
    from sparkv.runtime.heap import keep_freed_memory

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default=None, help="another checkout's root")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--tokens", type=int, default=2048, help="the context's tokens")
    p.add_argument("--answer", type=int, default=32, help="an answer's tokens")
    p.add_argument("--out", default=None)
    p.add_argument("--capture", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.capture:
        torch.save(captured_rows(a.tokens, a.answer), a.capture)
        return 0
    torch.set_num_threads(2)
    keep_freed_memory()               # the C heap's thresholds as the service's process sets them
    mods = {"this": density}
    if a.against:
        mods["against"] = other_density(a.against)
    table: list[dict[str, Any]] = []
    for kind, sums in captured_in_child(a.tokens, a.answer):
        q, _, pos, s = sums[0]
        same = all(torch.equal(*[mod._column_mass(*rows) for mod in (density, other)])
                   for rows in sums for other in mods.values())
        reps = a.reps if len(sums) == 1 else max(3, a.reps // 8)
        row: dict[str, Any] = {"call": kind,
                               "layers": sum(int(x[0].shape[0]) for x in sums),
                               "rows": int(pos.numel()), "keys": s, "same_sums": same,
                               **{f"{k}_s": round(v, 5)
                                  for k, v in fastest(mods, sums, reps).items()}}
        if a.against:
            row["speedup"] = round(row["against_s"] / row["this_s"], 3)
        table.append(row)
        print(row, flush=True)
    print("\n| call | rows x keys x layers | this | against | speedup | same sums |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['call']} | {r['rows']} x {r['keys']} x {r['layers']} | "
              f"{r['this_s'] * 1e3:.1f} ms | {r.get('against_s', float('nan')) * 1e3:.1f} ms | "
              f"{r.get('speedup', float('nan')):.2f}x | {r['same_sums']} |")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({"args": vars(a), "rows": table},
                                                  indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
