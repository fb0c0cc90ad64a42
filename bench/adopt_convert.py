"""What converting an adopted context to its levels costs (``sparkv.device.keeper.
adopted_runs``, the first part of ``ContextService.import_context`` and of a new context's
fold): each level's rows quantized alone (now) against each level quantizing the whole layer
and keeping its chunks' rows (before 2026-12-07, rebuilt here as the baseline: the same runs,
bit for bit). SmolLM2 in process, the bundled story's first ``--tokens`` tokens prefilled
once, at the levels the service gives them (its default ratio: mostly k8v4, a few int8, the
fp sink); both ways alternated ``--rounds`` times in one process, the ratio paired by round.
2 torch threads; no paper figure.

    python bench/adopt_convert.py [--rounds 9] [--tokens 2048]
                                  [--out bench/results/adopt_convert_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402


def whole_layer_conversion(layers: Any, g: Any, levels: list[str], dtype: Any) -> list[Any]:
    """The baseline: per layer and level, the whole layer's rows converted, then the level's
    chunks' rows cut from them (K and V of every run)."""
    from sparkv.cache.payload import joined_rows, values_at_level
    from sparkv.device import keeper

    hh = g.num_kv_heads
    by_level: dict[str, list[int]] = {}
    for t, lv in enumerate(levels):
        by_level.setdefault(lv, []).append(t)
    out = []
    for layer in range(g.num_layers):
        k, v = keeper.layer_kv(layers, layer, 0, g.num_tokens)
        k_rows = keeper._chunk_rows(k, g.chunk_tokens, dtype)
        v_rows = keeper._chunk_rows(v, g.chunk_tokens, dtype)
        for lv, ts in by_level.items():
            kl, vl = values_at_level(k_rows, v_rows, "fp", lv, dtype)
            spans = [(hh * g.token_range(a)[0], hh * g.token_range(b - 1)[1])
                     for a, b in keeper._spans(ts)]
            out.append((joined_rows(kl, spans), joined_rows(vl, spans)))
    return out


def level_rows_conversion(layers: Any, g: Any, levels: list[str], dtype: Any) -> list[Any]:
    """Now: :func:`~sparkv.device.keeper.adopted_runs` (K and V of every run)."""
    from sparkv.device.keeper import adopted_runs

    return [(r.k, r.v) for runs in adopted_runs(layers, g, levels, dtype) for r in runs]


def same(a: list[Any], b: list[Any]) -> bool:
    """Whether both ways gave the same values (codes, scales and zeros, or fp rows)."""
    import torch

    from sparkv.cache.levels import QuantizedTensor

    def parts(x: Any) -> list[Any]:
        return [x.codes, x.scale, x.zero] if isinstance(x, QuantizedTensor) else [x]
    return len(a) == len(b) and all(torch.equal(p, q) for x, y in zip(a, b)
                                    for s, t in zip(x, y) for p, q in zip(parts(s), parts(t)))


def main() -> int:
    from sparkv.device import ContextService
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime.generate import reference_prefill

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lm, _, ids = story_model(a.tokens)
    layers = list(reference_prefill(lm, ids))
    g = ChunkGeometry.from_config(lm.config, len(ids), 16)
    with tempfile.TemporaryDirectory() as d:
        svc = ContextService(lm, 1 << 31, d, keep_working=False, journal=False)
        levels = list(svc.contexts[svc.import_context(ids, layers)].levels)
        svc.close()
    ways = {"whole_layer": whole_layer_conversion, "level_rows": level_rows_conversion}
    assert same(*(fn(layers, g, levels, lm.dtype) for fn in ways.values()))
    secs: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(a.rounds):
        for w in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            t = time.perf_counter()
            ways[w](layers, g, levels, lm.dtype)
            secs[w].append(time.perf_counter() - t)
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{w} {secs[w][-1]:.3f} s" for w in ways),
              flush=True)
    mix = {lv: levels.count(lv) for lv in sorted(set(levels))}
    ratio = statistics.median(n / o for n, o in zip(secs["level_rows"], secs["whole_layer"]))
    med = {w: round(statistics.median(x), 4) for w, x in secs.items()}
    print(f"{len(ids)} tokens at {mix}: whole layer per level {med['whole_layer']:.3f} s, "
          f"each level's rows {med['level_rows']:.3f} s; paired ratio {ratio:.2f}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "tokens": len(ids), "levels": mix, "seconds": secs,
             "median": med, "level_rows_over_whole_layer": round(ratio, 3)}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
