"""What a kept response saves and costs (docs/asks.md, "Kept responses and
previous_response_id"): one conversation of ``--turns`` turns asked three ways through the
Responses route's own work (no model, no socket):

* ``whole``: each request sends the whole conversation so far as ``input`` (the earlier
  questions and the earlier responses' output items), as an app does without kept responses;
* ``chained``: each request sends only its question and names the previous response
  (``previous_response_id``); the service finds it and builds the same turns;
* ``conv``: each request sends only its question and names its conversation (the
  Conversations API); the service builds the same turns from the conversation's items and
  appends the turn to it (its file appended and synced).

Per turn: the request's JSON bytes, the route's work before the ask (reading the body, finding
the previous response, building the turns; best of 5), and for ``chained`` the keeping of the
answer (its :class:`~sparkv.asks.respstore.StoredResponse` and its file, written atomically and
synced on this machine's disk in ``--dir``), then the store's bytes (each response holding its
own turn and a link to the one before), beside what the first design held (each response holding
its whole conversation: ``store_bytes_whole``, the same responses flattened), and the time a new
process takes to read every file back (past the page cache) and link them, as a restarted
service does (median of 5). Answers are scripted text of ``--answer-chars``.

    python bench/kept_responses.py [--turns 32] [--out bench/results/kept_responses_cpu.json]

Wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from sparkv.asks.convfiles import ConversationFiles
from sparkv.asks.convroutes import ConversationTurn, conversation_of
from sparkv.asks.convstore import ConversationStore
from sparkv.asks.respfiles import ResponseFiles
from sparkv.asks.respkept import ResponseKeeper, previous
from sparkv.asks.respschemas import ResponsesBody
from sparkv.asks.respstore import ResponseStore

RUNS = 5
APP = "app:bench"


def _answer(turn: int, chars: int) -> dict[str, Any]:
    text = (f"Answer {turn}: " + "the licence lets anyone copy it " * chars)[:chars]
    rid = f"resp_{turn:032x}"
    return {"id": rid, "object": "response", "status": "completed", "output": [
        {"type": "message", "id": f"msg_{turn:032x}", "status": "completed",
         "role": "assistant", "content": [{"type": "output_text", "text": text,
                                           "annotations": [], "logprobs": []}]}]}


def _question(turn: int) -> dict[str, Any]:
    return {"role": "user", "content": f"Question {turn}: what does part {turn} of the text say "
                                       f"about who may copy it, and on what terms?"}


def _best(f: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(RUNS):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def run(turns: int, chars: int, folder: pathlib.Path) -> dict[str, Any]:
    store = ResponseStore(max(256, turns), 256_000_000, files=ResponseFiles(folder))
    whole_items: list[dict[str, Any]] = []
    rows, last, whole_bytes = [], None, 0
    for t in range(turns):
        whole_items.append(_question(t))
        whole = {"model": "0" * 32, "input": list(whole_items), "instructions": "Be brief."}
        chained = {"model": "0" * 32, "input": [_question(t)], "instructions": "Be brief.",
                   "previous_response_id": last}
        read_whole = _best(lambda: ResponsesBody.model_validate(whole).turns())
        body = ResponsesBody.model_validate(chained)

        def read_chained() -> Any:
            b = ResponsesBody.model_validate(chained)
            earlier = previous(store, APP, b.previous_response_id)
            return b.turns(earlier.conversation() if earlier else ())

        read_chain = _best(read_chained)
        earlier = previous(store, APP, last)
        assert read_chained() == ResponsesBody.model_validate(whole).turns()   # the same turns
        answer = _answer(t, chars)
        t0 = time.perf_counter()
        asyncio.run(ResponseKeeper(store, APP, earlier, body.items())(answer))
        keep_s = time.perf_counter() - t0
        whole_items += answer["output"]
        last = answer["id"]
        kept = store.get(APP, last)
        assert kept is not None and len(kept.conversation()) == len(whole_items)
        whole_bytes += kept.flattened().nbytes
        rows.append({"turn": t + 1, "whole_bytes": len(json.dumps(whole)),
                     "chained_bytes": len(json.dumps(chained)),
                     "whole_read_us": read_whole * 1e6, "chained_read_us": read_chain * 1e6,
                     "keep_ms": keep_s * 1e3,
                     "store_bytes": store.stats()["bytes"], "store_bytes_whole": whole_bytes})
    took, loaded = zip(*(_read_back(folder, max(256, turns)) for _ in range(RUNS)))
    return {"rows": rows, "read_back_s": statistics.median(took), "read_back": loaded[0],
            "files_bytes": sum(p.stat().st_size for p in folder.glob("*.json"))}


def run_conversation(turns: int, chars: int, folder: pathlib.Path) -> dict[str, Any]:
    """The same conversation through the Conversations API: each request names the
    conversation; its turn is appended to the conversation's file (synced)."""
    convs = ConversationStore(16, 256_000_000, files=ConversationFiles(folder))
    cid = convs.create(APP, [], None).info["id"]
    whole_items: list[dict[str, Any]] = []
    rows = []
    for t in range(turns):
        whole_items.append(_question(t))
        named = {"model": "0" * 32, "input": [_question(t)], "instructions": "Be brief.",
                 "conversation": cid}

        def read_named() -> Any:
            b = ResponsesBody.model_validate(named)
            return b.turns(conversation_of(convs, APP, cid).items)

        read_s = _best(read_named)
        whole = {"model": "0" * 32, "input": list(whole_items), "instructions": "Be brief."}
        assert read_named() == ResponsesBody.model_validate(whole).turns()    # the same turns
        answer = _answer(t, chars)
        body = ResponsesBody.model_validate(named)
        t0 = time.perf_counter()
        asyncio.run(ConversationTurn(convs, APP, cid, body.items())(answer))
        rows.append({"conv_read_us": read_s * 1e6, "conv_add_ms": (time.perf_counter() - t0)
                     * 1e3, "conv_file_bytes": (folder / f"{cid}.jsonl").stat().st_size})
        whole_items += answer["output"]
    took, loaded = zip(*(_read_back(folder, 16, _CONV_READ_BACK) for _ in range(RUNS)))
    return {"rows": rows, "read_back_s": statistics.median(took), "read_back": loaded[0]}


#: a restarted service's reading of the conversations' files, in a new process
_CONV_READ_BACK = """
import sys, time
from sparkv.asks.convfiles import ConversationFiles
from sparkv.asks.convstore import ConversationStore
t0 = time.perf_counter()
n = ConversationStore(int(sys.argv[2]), 256_000_000, files=ConversationFiles(sys.argv[1])).load()
print(time.perf_counter() - t0, n)
"""


#: a restarted service's reading of the files, in a new process (its imports not counted)
_READ_BACK = """
import sys, time
from sparkv.asks.respfiles import ResponseFiles
from sparkv.asks.respstore import ResponseStore
t0 = time.perf_counter()
n = ResponseStore(int(sys.argv[2]), 256_000_000, files=ResponseFiles(sys.argv[1])).load()
print(time.perf_counter() - t0, n)
"""


def _read_back(folder: pathlib.Path, most: int, script: str = _READ_BACK) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", script, str(folder), str(most)],
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), int(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=32)
    ap.add_argument("--answer-chars", type=int, default=400)
    ap.add_argument("--dir", type=pathlib.Path, default=None,
                    help="where the files are written (default: a new folder in the working "
                         "directory's disk, removed after)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    folder = args.dir or pathlib.Path(tempfile.mkdtemp(prefix=".kept-bench-", dir="."))
    try:
        got = run(args.turns, args.answer_chars, folder / "responses")
        conv = run_conversation(args.turns, args.answer_chars, folder / "conversations")
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    rows = [{**r, **c} for r, c in zip(got["rows"], conv["rows"])]
    print(f"{'turn':>4} {'whole B':>9} {'chained B':>9} {'whole us':>9} {'chained us':>10} "
          f"{'keep ms':>8} {'store B':>9} {'whole B':>10} {'conv us':>8} {'conv ms':>8} "
          f"{'conv file B':>11}")
    for r in rows:
        if r["turn"] in (1, 2, 4, 8, 16, 32, 64, 128) or r is rows[-1]:
            print(f"{r['turn']:>4} {r['whole_bytes']:>9} {r['chained_bytes']:>9} "
                  f"{r['whole_read_us']:>9.0f} {r['chained_read_us']:>10.0f} "
                  f"{r['keep_ms']:>8.2f} {r['store_bytes']:>9} {r['store_bytes_whole']:>10} "
                  f"{r['conv_read_us']:>8.0f} {r['conv_add_ms']:>8.2f} "
                  f"{r['conv_file_bytes']:>11}")
    sent = (sum(r["whole_bytes"] for r in rows), sum(r["chained_bytes"] for r in rows))
    keep = statistics.median(r["keep_ms"] for r in rows)
    summary = {"turns": len(rows), "answer_chars": args.answer_chars,
               "sent_bytes_whole": sent[0], "sent_bytes_chained": sent[1],
               "keep_ms_median": keep, "read_back_s": got["read_back_s"],
               "read_back": got["read_back"], "files_bytes": got["files_bytes"],
               "store_bytes": rows[-1]["store_bytes"],
               "store_bytes_whole": rows[-1]["store_bytes_whole"],
               "conv_add_ms_median": statistics.median(r["conv_add_ms"] for r in rows),
               "conv_file_bytes": rows[-1]["conv_file_bytes"],
               "conv_read_back_s": conv["read_back_s"]}
    print(f"\nsent over {len(rows)} turns: whole {sent[0]:,} B, chained {sent[1]:,} B "
          f"({sent[0] / sent[1]:.1f}x less); keeping a response: {keep:.2f} ms median "
          f"(file synced); {got['read_back']} files ({got['files_bytes']:,} B) read back by a "
          f"new process in {got['read_back_s'] * 1e3:.0f} ms (median of {RUNS}); the store "
          f"holds {summary['store_bytes']:,} B, each response holding its whole conversation "
          f"{summary['store_bytes_whole']:,} B "
          f"({summary['store_bytes_whole'] / summary['store_bytes']:.1f}x)")
    print(f"as a conversation: a turn added (appended, synced) in "
          f"{summary['conv_add_ms_median']:.2f} ms median; its file "
          f"{rows[-1]['conv_file_bytes']:,} B, read back by a new process in "
          f"{conv['read_back_s'] * 1e3:.0f} ms")
    if args.out:
        args.out.write_text(json.dumps({**summary, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
