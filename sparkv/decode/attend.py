"""What one clustered layer attends at a step, and the attention call: :class:`LayerAttention`.

Per KV head a layer attends its window, its selected clusters' flushed entries and write-buffer
tails, every other tail (``attend_tails``: RAM, no read) and its RAM-only entries (buffers,
waiting entries), each position once. With a row arena (float32 on the CPU) they are runs of
the arena and one :func:`~sparkv.decode.fused.fused_attention` call reads them where they lie
(:meth:`LayerAttention.fused`); otherwise they are gathered into one padded tensor
(:meth:`LayerAttention.gather`, :mod:`sparkv.decode.gather`) for
:func:`~sparkv.decode.gather.padded_attention`. The recall probe (measurement only) keeps a
full copy of the layer's entries and compares (:meth:`LayerAttention.probe`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sparkv.decode.fused import fused_attention
from sparkv.decode.gather import Gathered, HeadParts, pad_heads, padded_attention
from sparkv.decode.index import ClusterIndex, TokenIndex
from sparkv.decode.rows import RowArena, Rows
from sparkv.decode.stats import Counters
from sparkv.decode.store import ClusterStore, FlushedData, TokenStore
from sparkv.decode.window import RecentWindow


class LayerAttention:
    """One layer's attention over its window and selected clusters (module docstring).

    Args:
        store, indexes, window: the layer's flash file, index per KV head and window.
        arena: the row arena of every clustered entry in RAM, or None (padded attention).
        counters: where the attended entries are counted.
        group: query heads per KV head.
        attend_tails: attend every write-buffer tail, selected or not.
        probe_capacity: positions of the probe's full copy (None: no probe).
    """

    def __init__(self, store: ClusterStore | TokenStore,
                 indexes: Sequence[ClusterIndex | TokenIndex], window: RecentWindow,
                 arena: RowArena | None, counters: Counters, *, group: int, attend_tails: bool,
                 probe_capacity: int | None) -> None:
        self.store, self.indexes, self.window = store, indexes, window
        self.arena, self.counters = arena, counters
        self.group, self.attend_tails = group, attend_tails
        self.probing = probe_capacity is not None
        h, _, d = window.sink_k.shape
        self.heads, self.d = int(h), int(d)
        if probe_capacity is not None:
            self.shadow_k = torch.zeros(self.heads, probe_capacity, self.d,
                                        dtype=window.sink_k.dtype)
            self.shadow_v = torch.zeros_like(self.shadow_k)

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float | None,
               selected: list[list[int]], step_data: dict[int, FlushedData],
               ) -> tuple[torch.Tensor, list]:
        """``q [1, Hq, nq, D]`` over the window and, per KV head, its ``selected`` clusters
        (their flushed entries in ``step_data``) -> ``[1, Hq, nq, D]``, and the per-head
        attended entries when probing (else ``[]``)."""
        if self.arena is not None:
            return self.fused(selected, step_data, q, q_pos, scale)
        gathered = self.gather(selected, step_data)
        out = padded_attention(q, gathered, q_pos, scale)
        return out, gathered.heads() if self.probing else []

    def fused(self, selected: list[list[int]], step_data: dict[int, FlushedData],
              q: torch.Tensor, q_pos: torch.Tensor,
              scale: float | None) -> tuple[torch.Tensor, list]:
        """Attention over the window and, per KV head, the arena runs of :meth:`runs`, in one
        :func:`~sparkv.decode.fused.fused_attention` call; also the per-head attended positions
        when probing (else ``[]``)."""
        cnt = self.counters
        arena = self.arena
        assert arena is not None
        runs, scratch = self.runs(selected, step_data)
        window = self.window.tensors()
        out, kept = fused_attention(q, q_pos, scale, arena.k, arena.v, arena.pos, runs, window,
                                    self.window.bounds())
        retrieved = int(kept[:, 1].sum())
        cnt.retrieved_entries += retrieved
        cnt.retrieved_bytes += retrieved * self.store.rec.entry_bytes
        cnt.attended_entries += int(kept[:, 0].sum()) + self.heads * int(window[2].shape[0])
        heads = [(None, None, torch.from_numpy(p)) for p in self.attended_positions(runs)] \
            if self.probing else []
        del scratch
        return out, heads

    def runs(self, selected: list[list[int]],
             step_data: dict[int, FlushedData]) -> tuple[np.ndarray, list[Rows]]:
        """``runs [N, 4]`` (head, first row, rows, selected) of the arena for the fused call: per
        KV head, its selected clusters' runs, one scratch run of their tails (selected), one of
        every other tail (``attend_tails``) and its RAM-only entries; and the scratch runs (held
        until the call is over). A selected cluster's entries not yet in the arena are put
        there (``step_data`` then holds its run)."""
        arena = self.arena
        assert arena is not None and isinstance(self.store, ClusterStore)
        tails = self._tails()
        units = self.store.units
        runs: list[tuple[int, int, int, int]] = []
        scratch: list[Rows] = []
        for h, idx in enumerate(self.indexes):
            sel: tuple[list, list, list] = ([], [], [])
            for uid in selected[h]:
                data = step_data.get(uid)
                if data is not None:
                    run = data if isinstance(data, Rows) and data.arena is arena \
                        else arena.put(*data)
                    step_data[uid] = run
                    if run.n:
                        runs.append((h, run.start, run.n, 1))
                u = units[uid]
                if u.tail:
                    sel[0].append(u.tail_k)
                    sel[1].append(u.tail_v)
                    sel[2].append(u.tail_pos)
            other: tuple[list, list, list] = ([], [], [])
            self._add_unselected(other, h, selected[h], tails, idx)
            for (ks, vs, ps), flag in ((sel, 1), (other, 0)):
                if ps:
                    r = arena.put(torch.cat(ks), torch.cat(vs), np.concatenate(ps))
                    scratch.append(r)
                    runs.append((h, r.start, r.n, flag))
        return np.array(runs, np.int64).reshape(-1, 4), scratch

    def attended_positions(self, runs: np.ndarray) -> list[np.ndarray]:
        """Per KV head, the positions a fused call over ``runs`` attends: the window, then the
        runs' rows outside it (what :func:`~sparkv.decode.fused.fused_attention` reads)."""
        arena = self.arena
        assert arena is not None
        wpos = self.window.tensors()[2].numpy()
        s_end, w0 = self.window.bounds()
        out = []
        for h in range(self.heads):
            ps = [arena.pos[a:a + n] for hh, a, n, _ in runs.tolist() if hh == h]
            p = np.concatenate(ps) if ps else np.zeros(0, np.int64)
            p = p[(p >= s_end) & (p < w0)]
            out.append(np.concatenate([wpos, p]))
        return out

    def gather(self, selected: list[list[int]], step_data: dict[int, FlushedData]) -> Gathered:
        """Every KV head's attended entries in one padded tensor: the window, then its selected
        entries (flushed + write buffer), its RAM-only entries, each position once."""
        cnt = self.counters
        s_end, w0 = self.window.bounds()
        parts: list[HeadParts] = []
        retrieved = 0
        for ks, vs, ps, n_sel in self.pieces(selected, step_data):
            if not ps:
                parts.append(([], [], np.zeros(0, np.int64), None))
                continue
            pk = np.concatenate(ps) if len(ps) > 1 else ps[0]
            m = (pk >= s_end) & (pk < w0)
            retrieved += int(m[:n_sel].sum())
            parts.append((ks, vs, pk, None if m.all() else m))
        cnt.retrieved_entries += retrieved
        cnt.retrieved_bytes += retrieved * self.store.rec.entry_bytes
        wk, wv, wpos = self.window.tensors()
        g = pad_heads(wk, wv, wpos, parts)
        cnt.attended_entries += int(g.lengths.sum())
        return g

    def pieces(self, selected: list[list[int]], step_data: dict[int, FlushedData],
               ) -> list[tuple[list, list, list, int]]:
        """Per head: the selected clusters' flushed entries and tails, every other write-buffer
        tail (``attend_tails``), then the head's RAM-only entries, as ``(k pieces, v pieces,
        pos pieces, entries of the selected pieces)``."""
        tails = self._tails()
        out = []
        for h, idx in enumerate(self.indexes):
            ks: list = []
            vs: list = []
            ps: list = []
            if isinstance(idx, TokenIndex):
                for uid in selected[h]:
                    data = step_data.get(uid)
                    if data is not None:
                        kt = torch.from_numpy(idx.last_keep[uid] - int(data[2][0]))
                        ks.append(data[0][kt])
                        vs.append(data[1][kt])
                        ps.append(idx.last_keep[uid])
            else:
                self._add_selected((ks, vs, ps), selected[h], step_data)
            n_sel = sum(len(p) for p in ps)
            self._add_unselected((ks, vs, ps), h, selected[h], tails, idx)
            out.append((ks, vs, ps, n_sel))
        return out

    def _add_selected(self, into: tuple[list, list, list], selected: list[int],
                      step_data: dict[int, FlushedData]) -> None:
        """A head's ``selected`` clusters' flushed entries and tails, appended to ``into``'s
        ``(k, v, pos)`` pieces."""
        ks, vs, ps = into
        units = self.store.units  # type: ignore[union-attr]
        for uid in selected:
            data = step_data.get(uid)
            if data is not None:
                ks.append(data[0])
                vs.append(data[1])
                ps.append(data[2])
            u = units[uid]
            if u.tail:
                ks.append(u.tail_k)
                vs.append(u.tail_v)
                ps.append(u.tail_pos)

    def _tails(self) -> dict[int, list]:
        """KV head -> its clusters with a write-buffer tail, when every tail is attended
        (``attend_tails``: a tail is in RAM, attended whether its cluster is selected or not,
        like the buffers and the window; it costs no read), else ``{}``."""
        tails: dict[int, list] = {}
        if self.attend_tails and isinstance(self.store, ClusterStore):
            for u in self.store.tails():
                tails.setdefault(u.head, []).append(u)
        return tails

    @staticmethod
    def _add_unselected(into: tuple[list, list, list], h: int, selected: list[int],
                        tails: dict[int, list], idx: ClusterIndex | TokenIndex) -> None:
        """Head ``h``'s tails of unselected clusters (``tails``: :meth:`_tails`), then its
        RAM-only entries, appended to ``into``'s ``(k, v, pos)`` pieces."""
        ks, vs, ps = into
        if tails:
            sel_set = set(selected)
            for u in tails.get(h, ()):
                if u.uid not in sel_set:
                    ks.append(u.tail_k)
                    vs.append(u.tail_v)
                    ps.append(u.tail_pos)
        rk, rv, rp = idx.resident()
        if len(rp):
            ks.append(rk)
            vs.append(rv)
            ps.append(rp)

    # ---- the recall probe (measurement only) -------------------------------------------------------
    def record(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Entries ``[H, q, D]`` at positions ``start ..`` into the probe's full copy."""
        q = int(k.shape[1])
        self.shadow_k[:, start:start + q] = k
        self.shadow_v[:, start:start + q] = v

    def probe(self, q: torch.Tensor, out: torch.Tensor, heads: list,
              scale: float | None, n: int) -> None:
        """Attention-mass recall of what was attended (``heads``, :meth:`attend`), and the
        output's relative error against full attention over every entry (positions
        ``0 .. n-1``; measurement only, not part of the policy)."""
        cnt = self.counters
        g = self.group
        sc = scale if scale is not None else self.d ** -0.5
        for h, (_, _, pos) in enumerate(heads):
            qg = q[0, h * g:(h + 1) * g, 0].float()                         # [G, D]
            logits = qg @ self.shadow_k[h, :n].float().T * sc
            p = torch.softmax(logits, -1)
            mask = torch.zeros(n, dtype=torch.bool)
            mask[pos.long()] = True
            recall = p[:, mask].sum(-1)                                     # [G]
            full = p @ self.shadow_v[h, :n].float()
            approx = out[0, h * g:(h + 1) * g, 0].float()
            err = (approx - full).norm(dim=-1) / full.norm(dim=-1).clamp_min(1e-12)
            cnt.recall_sum += float(recall.sum())
            cnt.error_sum += float(err.sum())
            cnt.recall_n += g
