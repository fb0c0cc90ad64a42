"""Split answer rows into two halves of disjoint tasks: pass-key tasks by the parity of their
seed index, QA questions by the parity of their position (sorted ids)."""
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
qa = sorted({r["probe"] for r in rows if r["family"] == "qa"})
qa_half = {p: i % 2 for i, p in enumerate(qa)}
def half(r):
    if r["family"] == "qa":
        return qa_half[r["probe"]]
    return int(r["context"].rsplit("-", 1)[1]) % 2
outs = [open(sys.argv[2], "w"), open(sys.argv[3], "w")]
n = [0, 0]
for r in rows:
    h = half(r); outs[h].write(json.dumps(r) + "\n"); n[h] += 1
print(n)
