"""Side-by-side table of ``sparkv bench contexts`` runs made before and after a change (issue 43):
per config and pattern, each system's mean switch, the ratios VLLM-SQ / LLMS and swap / LLMS
beside the paper's figures, LLMS's switch against its own flash read time (its bytes read per
switch at the flash profile's bandwidth), and the peak RSS ``/usr/bin/time -v`` recorded.

    python bench/contexts_ab.py DIR [--out F.json]

``DIR`` holds ``contexts-<n>x<fraction>-{before,after}.json`` and the ``.log`` of each run (the
``time -v`` output and the load averages at start and end).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

PAPER = {"vllm-sq": "9.7x", "swap": "1-2 orders", "active": "1.99-2.85x"}


def rss_mb(log: Path) -> float | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text(errors="ignore"))
    return int(m.group(1)) / 1024 if m else None


def loads(log: Path) -> list[str]:
    return re.findall(r"load ([\d.]+ [\d.]+ [\d.]+)", log.read_text(errors="ignore"))


def flash_MBps() -> float | None:
    try:
        from sparkv.cache import flash_profile_path, load_flash_profile
        from sparkv.runtime.model import cache_dir

        prof = load_flash_profile(flash_profile_path(cache_dir()))
        return float(prof["read_MBps"]) if prof else None
    except Exception:  # noqa: BLE001 - no profile: no comparison
        return None


def rows(d: Path) -> list[dict[str, Any]]:
    out = []
    mbps = flash_MBps()
    for f in sorted(d.glob("contexts-*-*.json")):
        m = re.match(r"contexts-(\d+)x([\d.]+)-(before|after)\.json", f.name)
        if not m:
            continue
        res = json.loads(f.read_text())
        log = f.with_suffix(".log")
        calls = res["settings"]["calls"]
        for pattern, p in res["patterns"].items():
            by = {r["system"]: r for r in p["rows"]}
            llms = by.get("llms", {})
            read_ms = (llms.get("read_bytes", 0) / calls / (mbps * 1e6) * 1e3) if mbps else None
            out.append({
                "contexts": int(m.group(1)), "fraction": float(m.group(2)), "side": m.group(3),
                "pattern": pattern, "unlimited_ms": p["unlimited"]["mean_switch_ms"],
                **{f"{s}_ms": r.get("mean_switch_ms") for s, r in by.items()},
                "vllm_sq_over_llms": by["vllm-sq"]["mean_switch_ms"] / llms["mean_switch_ms"],
                "swap_over_llms": by["swap"]["mean_switch_ms"] / llms["mean_switch_ms"],
                "llms_read_ms_per_switch": read_ms,
                "llms_switch_over_read": (llms["mean_switch_ms"] / read_ms) if read_ms else None,
                "llms_identical": llms.get("identical_answers"),
                "llms_passkey": llms.get("passkey_acc"),
                "unlimited_passkey": p["unlimited"].get("passkey_acc"),
                "peak_rss_mb": rss_mb(log) if log.exists() else None,
                "load_average": loads(log) if log.exists() else None,
                "seconds": res.get("seconds")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rs = rows(Path(a.dir))
    head = ("| contexts x budget | pattern | side | swap ms | vllm-sq ms | llms ms | unlimited ms "
            f"| VLLM-SQ / LLMS (paper {PAPER['vllm-sq']}) | swap / LLMS (paper {PAPER['swap']}) "
            "| LLMS switch / its read | peak RSS MB |")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for r in sorted(rs, key=lambda r: (r["contexts"], r["fraction"], r["pattern"],
                                       r["side"] != "before")):
        sr = r["llms_switch_over_read"]
        print(f"| {r['contexts']} x {r['fraction']:.0%} | {r['pattern']} | {r['side']} "
              f"| {r.get('swap_ms', 0):.0f} | {r.get('vllm-sq_ms', 0):.0f} "
              f"| {r.get('llms_ms', 0):.0f} | {r['unlimited_ms']:.0f} "
              f"| {r['vllm_sq_over_llms']:.2f} | {r['swap_over_llms']:.2f} "
              f"| {'-' if sr is None else f'{sr:.1f}'} | {r['peak_rss_mb'] or 0:.0f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"flash_read_MBps": flash_MBps(), "rows": rs},
                                          indent=1))


if __name__ == "__main__":
    main()
