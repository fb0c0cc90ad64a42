"""Full KV streamed from flash every token: :class:`StreamedKV`, the ``stream`` policy.

The baseline of a context whose full KV does not fit the RAM budget (docs/dynakv.md, "Over
RAM"): every entry is on flash, each head's entries in position order (the
:class:`~sparkv.decode.store.TokenStore` layout: 4 KiB pages written once, XXH64-checked, read
past the page cache with ``O_DIRECT`` or ``posix_fadvise(DONTNEED)``), and at every step each
layer reads **all** of its pages back (one read operation per KV head) and attends every entry.
RAM holds one layer's read buffer (two with ``prefetch``: the I/O thread reads layer ``l+1``
while ``l`` computes, when two fit the budget) and each head's partial last page.

It has the interface :class:`~sparkv.decode.hf.DynaKVCache` and
:class:`~sparkv.decode.session.DecodeSession` use of a :class:`~sparkv.decode.policy.ClusteredKV`
(``layers[l].update / attend``, the counters, the flash counters, the stats), with no clusters.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from sparkv.cache.layer import HeadEntries
from sparkv.decode.cache import ClusterCache
from sparkv.decode.config import DecodeConfig
from sparkv.decode.gather import Gathered, padded_attention
from sparkv.decode.policy import drain
from sparkv.decode.stats import Counters
from sparkv.decode.store import PAGE, IOStats, TokenStore


class StreamedLayer:
    """One layer: its entries on flash (:class:`TokenStore`), read whole at every step."""

    def __init__(self, eng: "StreamedKV", l: int, heads: Sequence[HeadEntries]) -> None:  # noqa: E741
        self.eng, self.l = eng, l
        self.indexes: list = []
        self.store = TokenStore(eng.dir / f"layer{l:03d}.pages", eng.H, eng.D, eng.dtype, eng.io,
                                max_positions=eng.max_positions, direct=eng.cfg.direct,
                                executor=eng.io_pool)
        for h, e in enumerate(heads):
            self.store.add(h, e.k.to(eng.dtype), e.v.to(eng.dtype), reason="prefill")
        self.end = int(heads[0].pos.shape[0])

    def read(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every flushed entry of every head: ``(k, v [H, n, D], n)`` (one read per head)."""
        st = self.store
        n = st.count[0]
        pages = st.rec.pages_for(n)
        ks, vs = [], []
        t0 = time.perf_counter()
        for h in range(self.eng.H):
            if not pages:
                break
            recs = st.rec.unpack(st.file.read(st.uid_of(h, 0), pages), pages)[:n]
            ks.append(recs[:, :st.d])
            vs.append(recs[:, st.d:])
        self.eng.io.count_read("retrieve", len(ks), len(ks) * pages * PAGE, len(ks) * n,
                               time.perf_counter() - t0)
        if not ks:
            z = torch.zeros(self.eng.H, 0, self.eng.D, dtype=self.eng.dtype)
            return z, z, 0
        return torch.stack(ks), torch.stack(vs), n

    def update(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """New entries ``[H, q, D]`` at the next positions; returns the positions."""
        q = int(k.shape[1])
        pos = torch.arange(self.end, self.end + q)
        self._new = (k.to(self.eng.dtype), v.to(self.eng.dtype))
        self.end += q
        return pos

    def attend(self, q: torch.Tensor, scale: float | None, q_pos: torch.Tensor) -> torch.Tensor:
        eng, cnt = self.eng, self.eng.counters
        t0 = time.perf_counter()
        k, v, n = eng.take(self.l)
        eng.submit((self.l + 1) % len(eng.layers))
        t1 = time.perf_counter()
        cnt.io_s += t1 - t0
        nk, nv = self._new
        st = self.store
        tails_k = torch.stack(st.tail_k) if st.tail_k[0].shape[0] else None
        parts_k = [k] + ([tails_k] if tails_k is not None else []) + [nk]
        parts_v = [v] + ([torch.stack(st.tail_v)] if tails_k is not None else []) + [nv]
        kk, vv = torch.cat(parts_k, 1), torch.cat(parts_v, 1)
        length = int(kk.shape[1])
        pos = torch.arange(length).expand(eng.H, length)
        g = Gathered(kk, vv, pos, torch.ones(eng.H, length, dtype=torch.bool),
                     np.full(eng.H, length))
        out = padded_attention(q, g, q_pos, scale)
        t2 = time.perf_counter()
        cnt.attend_s += t2 - t1
        cnt.attended_entries += eng.H * length
        cnt.retrieved_entries += eng.H * n
        cnt.retrieved_bytes += eng.H * n * st.rec.entry_bytes
        for h in range(eng.H):
            st.add(h, nk[h], nv[h])
        cnt.update_s += time.perf_counter() - t2
        return out

    def ram_bytes(self) -> dict[str, int]:
        return {"window": 0, "buffers": 0,
                "write_buffers": self.store.tail_entries * self.store.rec.entry_bytes}

    def close(self) -> None:
        self.store.close(remove=True)


class StreamedKV:
    """Every layer's full KV on flash, streamed each step (module docstring). Arguments as
    :class:`~sparkv.decode.policy.ClusteredKV`'s (``queries`` unused)."""

    def __init__(self, entries: Sequence[Sequence[HeadEntries]], cfg: DecodeConfig, *,
                 final_tokens: int, max_positions: int, flash_dir: str | Path | None = None
                 ) -> None:
        self.cfg = cfg
        first = entries[0][0]
        self.L, self.H = len(entries), len(entries[0])
        self.D = int(first.k.shape[1])
        self.dtype = first.k.dtype
        n = int(first.pos.shape[0])
        self.final_tokens = max(final_tokens, n)
        self.max_positions = max(max_positions, self.final_tokens)
        eb = 2 * self.D * torch.empty(0, dtype=self.dtype).element_size()
        self.entry_bytes = eb
        self.final_kv_bytes = self.final_tokens * self.L * self.H * eb
        b = cfg.ram_budget
        self.ram_budget = None if b is None else (int(b * self.final_kv_bytes)
                                                  if isinstance(b, float) and b <= 1.0 else int(b))
        layer = self.final_tokens * self.H * eb
        tails = PAGE * self.H * self.L
        if self.ram_budget is not None and layer + tails > self.ram_budget:
            raise ValueError(f"ram_budget {self.ram_budget} B is below one layer's KV read buffer "
                             f"and the partial pages ({layer + tails} B)")
        #: two layers in flight when both fit: the next layer is read while this one computes
        self.prefetch = cfg.prefetch and (self.ram_budget is None
                                          or 2 * layer + tails <= self.ram_budget)
        self.fixed = (2 if self.prefetch else 1) * layer + tails
        base = Path(flash_dir) if flash_dir is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="stream-", dir=base))
        self.io = IOStats()
        self.io_pool = ThreadPoolExecutor(1, thread_name_prefix="stream-io")
        self.counters = Counters()
        self.cache = ClusterCache(0)
        self.cache_capacity = 0
        self.prefill_splits = 0
        self._futures: dict[int, Future] = {}
        self.layers: list[StreamedLayer] = []
        t0 = time.perf_counter()
        try:
            for l, heads in enumerate(entries):  # noqa: E741
                self.layers.append(StreamedLayer(self, l, heads))
            self.flush()
        except BaseException:
            self.close()
            raise
        self.build_s = time.perf_counter() - t0

    def submit(self, l: int) -> None:  # noqa: E741
        if self.prefetch and l not in self._futures:
            self._futures[l] = self.io_pool.submit(self.layers[l].read)

    def take(self, l: int) -> tuple[torch.Tensor, torch.Tensor, int]:  # noqa: E741
        fut = self._futures.pop(l, None)
        return fut.result() if fut is not None else self.layers[l].read()

    def end_step(self, tokens: int) -> None:
        cnt = self.counters
        cnt.steps += 1
        cnt.tokens += tokens
        cnt.ram_peak = max(cnt.ram_peak, self.ram_bytes()["total"])

    def ram_bytes(self) -> dict[str, int]:
        out = {"cache": 0, "window": 0, "buffers": 0, "write_buffers": 0,
               "staging": self.fixed - PAGE * self.H * self.L}
        for layer in self.layers:
            for k, v in layer.ram_bytes().items():
                out[k] += v
        out["total"] = sum(out.values())
        return out

    def index_bytes(self) -> int:
        return 0

    def check(self) -> None:
        pass

    def flush(self) -> None:
        for layer in self.layers:
            layer.store.file.flush()

    def close(self) -> None:
        drain(self._futures, self.io_pool)
        for layer in self.layers:
            layer.close()
        shutil.rmtree(self.dir, ignore_errors=True)
