"""Paired in one process: the slow-start cap (sparkv.scheduler.estimators.start_prior) on and
off, and local, in turn per trace, on the seeded adversarial traces whose manifest is slow (2K,
T=512, raw/q8/q5, a fresh 50 Mbit/s prior each ask: neither the last load's estimate nor the last
large download carried over). docs/scheduler.md, "A slow start".

    python bench/slow_start_ab.py 1,3,5,6,7,9,10,13,15 2 bench/results/slow_start_cap_s71.json
"""
import sys, tempfile, collections, statistics as st, json, gc
from sparkv.predictor.dtypes import load_model_in_dtype
from sparkv.runtime.heap import settle
from sparkv.runtime import sample_context_ids
from sparkv.edge.prompts import chat_context
from sparkv.server.process import ServerProcess
from sparkv.edge.session import EdgeSession
import sparkv.edge.session as SE
from sparkv.edge.options import AskOptions
from sparkv.edge.shaper import LinkShaper
from sparkv.scheduler.trace import adversarial_traces
_sp = SE.start_prior
MODE = {"cap": True}
SE.start_prior = lambda p, b, s: _sp(p, b, s) if MODE["cap"] else p
ids = [int(x) for x in sys.argv[1].split(",")]; rounds = int(sys.argv[2]); out = sys.argv[3]
alltr = adversarial_traces(max(ids) + 1, 0)
traces = [alltr[i] for i in ids]
names = ["cap", "nocap", "local"]
lm = load_model_in_dtype(None, dtype="auto", device="cpu"); settle()
ctx = chat_context(lm, sample_context_ids(lm, 2048))
res = collections.defaultdict(list); ROWS = []
with tempfile.TemporaryDirectory() as tmp:
    with ServerProcess(None, f"file://{tmp}/store", log_path=f"{tmp}/s.log", torch_threads=2) as srv:
        s = EdgeSession.connect(srv.url, model=lm, timeout_s=120.0)
        cid = s.client.create_context(token_ids=ctx, levels=["raw", "q8", "q5"], chunk_tokens=512)
        q = "What does this text say about warranty? Answer in one sentence."
        s.client.shaper = LinkShaper.unlimited()
        for strat in ("local", "sparkv", "stream", "hybrid"):
            s.ask(cid, q, AskOptions(strategy=strat, max_new_tokens=2, use_cache=False))
        k = 0
        for rnd in range(rounds):
            for tr in traces:
                k += 1
                for name in (names if k % 2 else names[::-1]):
                    MODE["cap"] = name == "cap"
                    strat = "local" if name == "local" else "sparkv"
                    opts = AskOptions(strategy=strat, max_new_tokens=4, use_cache=False, stop_at_eos=False)
                    s.client.shaper = LinkShaper(tr, rtt_s=0.02); s.priors.bandwidth_Bps = None; s.client.last_download = None
                    gc.collect(); gc.disable()
                    try:
                        r = s.ask(cid, q, opts)
                    finally:
                        gc.enable()
                    b = r.breakdown
                    res[(tr.name, name)].append(b.ttft_s)
                    ROWS.append(dict(trace=tr.name, round=rnd, variant=name, ttft_s=b.ttft_s, manifest_s=b.manifest_s, loading_s=b.loading_s, local_compute_s=b.local_compute_s, chunks_streamed=b.chunks_streamed, prelude_steps=b.prelude_steps, migrations=b.migrations, prior_mbps=r.instance.bandwidth_Bps * 8e-6 if r.instance is not None else None))
                    print(f"{tr.name:15s} {name:6s} ttft {b.ttft_s:.3f} man {b.manifest_s:.3f} load {b.loading_s:.3f} comp {b.local_compute_s:.3f} streamed {b.chunks_streamed} migr {b.migrations} prel {b.prelude_steps}", flush=True)
        s.close()
ratios = collections.defaultdict(list)
for (tn, name), v in res.items():
    if name != "local":
        for a, b in zip(v, res[(tn, "local")]):
            ratios[name].append(a / b)
summ = {k: {"median": st.median(v), "max": max(v), "mean": st.mean(v)} for k, v in ratios.items()}
print(summ)
json.dump({"rows": ROWS, "summary": summ}, open(out, "w"), indent=1)
