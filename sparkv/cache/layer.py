"""One layer's resident full-precision entries: :class:`LayerStore`.

Two layouts, one layer at a time:

* **dense** (how a context is loaded): ``k``, ``v`` ``[1, H, capacity, D]``; slot ``i`` holds
  position ``i`` of every head (the ``DynamicCache`` layout, so attention and generation read
  views, never copies). Slots not yet written are simply not visible: the chunk table says which
  ranges hold data.
* **ragged** (after pruning or compaction): per KV head ``h`` its own ``k[h]``, ``v[h]``
  ``[capacity_h, D]`` and ``pos[h]`` (int64 positions, ascending), ``length[h]`` entries used.
  A head keeps only what it keeps: real memory, not masks.

Both layouts keep spare capacity for decoded tokens (appended in place; a full layer grows by
an eighth, at least 64 entries).
Quantized chunks, flash chunks and absent chunks are not here: :class:`~sparkv.cache.memory.ContextKV`
owns those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkv.cache import zeroed
from sparkv.errors import SparkvError


class KVMemoryError(SparkvError):
    """A KV-memory operation that does not fit the context (shapes, positions, residency)."""


@dataclass
class HeadEntries:
    """Entries of one KV head: ``k``/``v`` ``[n, D]`` and their positions ``pos`` ``[n]``."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor


def _grow(n: int, need: int) -> int:
    """New capacity for ``need`` entries: an eighth more (at least 64), amortising appends
    without doubling a large layer's memory."""
    return max(need, n + max(n // 8, 64), 16)


class LayerStore:
    """The fp entries of one layer (see the module docstring)."""

    def __init__(self, num_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, lazy: bool = False) -> None:
        self.num_heads, self.head_dim = num_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.lazy = lazy
        self.ragged = False
        shape = (1, num_heads, capacity, head_dim)
        self.k: torch.Tensor | None = self._zeros(shape)
        self.v: torch.Tensor | None = self._zeros(shape)
        self.end = 0                    # dense: slots [0, end) may hold data
        # ragged layout
        self.hk: list[torch.Tensor] = []
        self.hv: list[torch.Tensor] = []
        self.hpos: list[torch.Tensor] = []
        self.length: list[int] = []

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.lazy:
            return zeroed.zeros(shape, self.dtype, self.device)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- accounting ------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        if not self.ragged:
            return [t for t in (self.k, self.v) if t is not None]
        return [*self.hk, *self.hv, *self.hpos]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def capacity(self) -> int:
        if not self.ragged:
            return 0 if self.k is None else int(self.k.shape[2])
        return max((int(t.shape[0]) for t in self.hk), default=0)

    # ---- dense layout ----------------------------------------------------------------------------
    def _ensure_dense(self, op: str) -> None:
        if self.ragged:
            raise KVMemoryError(f"{op} needs the dense layout; this layer is ragged")

    def _reserve_dense(self, slots: int) -> None:
        assert self.k is not None and self.v is not None
        cap = int(self.k.shape[2])
        if slots <= cap:
            return
        new = _grow(cap, slots)
        shape = (1, self.num_heads, new, self.head_dim)
        k, v = self._zeros(shape), self._zeros(shape)
        k[:, :, :cap] = self.k
        v[:, :, :cap] = self.v
        self.k, self.v = k, v

    def write_dense(self, h0: int, h1: int, start: int, k: torch.Tensor, v: torch.Tensor,
                    non_blocking: bool = False) -> None:
        """Heads ``h0:h1``, positions ``start .. start+n``, from ``[h1-h0, n, D]`` tensors
        (``non_blocking``: an asynchronous copy from pinned memory on the current CUDA stream)."""
        self._ensure_dense("write_dense")
        n = int(k.shape[1])
        self._reserve_dense(start + n)
        assert self.k is not None and self.v is not None
        self.k[0, h0:h1, start:start + n].copy_(k, non_blocking=non_blocking)
        self.v[0, h0:h1, start:start + n].copy_(v, non_blocking=non_blocking)
        self.end = max(self.end, start + n)

    def dense_view(self, h0: int, h1: int, start: int, stop: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views ``[h1-h0, stop-start, D]`` (dense layout)."""
        self._ensure_dense("dense_view")
        self._reserve_dense(stop)
        assert self.k is not None and self.v is not None
        return self.k[0, h0:h1, start:stop], self.v[0, h0:h1, start:stop]

    def prefix(self, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, H, stop, D]`` views of positions ``0 .. stop`` (dense layout)."""
        self._ensure_dense("prefix")
        assert self.k is not None and self.v is not None
        return self.k[:, :, :stop], self.v[:, :, :stop]

    # ---- ragged layout ---------------------------------------------------------------------------
    def to_ragged(self, keep: list[torch.Tensor], spare: int = 0) -> None:
        """Keeps, per head, the entries at positions ``keep[h]`` (any order, unique), and
        switches to the ragged layout (the dense arena is freed). From a ragged layer, ``keep``
        must be a subset of each head's positions."""
        self.hk, self.hv, self.hpos, self.length = self._ragged(keep, spare)
        self.k = self.v = None
        self.ragged = True

    def pruned(self, keep: list[torch.Tensor], spare: int = 0) -> "LayerStore":
        """A new ragged store of the entries at positions ``keep[h]`` (as :meth:`to_ragged`);
        this one is left as it is."""
        new = LayerStore(self.num_heads, self.head_dim, 0, self.dtype, self.device)
        new.to_ragged([torch.zeros(0, dtype=torch.long)] * self.num_heads)
        new.hk, new.hv, new.hpos, new.length = self._ragged(keep, spare)
        return new

    def _ragged(self, keep: list[torch.Tensor], spare: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int]]:
        if len(keep) != self.num_heads:
            raise KVMemoryError(f"keep lists {len(keep)} heads; the layer has {self.num_heads}")
        new_k, new_v, new_pos, lengths = [], [], [], []
        for h, want in enumerate(keep):
            want = torch.as_tensor(want, dtype=torch.long, device=self.device).sort().values
            if want.numel() and bool((want[1:] == want[:-1]).any()):
                raise KVMemoryError(f"head {h}: duplicate positions to keep")
            k, v, _ = self._head_entries(h, want)
            cap = int(want.numel()) + spare
            hk = torch.zeros((cap, self.head_dim), dtype=self.dtype, device=self.device)
            hv = torch.zeros_like(hk)
            hp = torch.zeros(cap, dtype=torch.long, device=self.device)
            n = int(want.numel())
            hk[:n], hv[:n], hp[:n] = k, v, want
            new_k.append(hk)
            new_v.append(hv)
            new_pos.append(hp)
            lengths.append(n)
        return new_k, new_v, new_pos, lengths

    def _head_entries(self, h: int, positions: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of head ``h`` at ``positions`` (ascending), from either layout."""
        if not self.ragged:
            assert self.k is not None and self.v is not None
            if positions.numel() and int(positions.max()) >= self.k.shape[2]:
                raise KVMemoryError(f"position {int(positions.max())} is past this layer's slots")
            return self.k[0, h, positions], self.v[0, h, positions], positions
        have = self.hpos[h][:self.length[h]]
        idx = torch.searchsorted(have, positions)
        ok = (idx < have.numel())
        if positions.numel() and not bool(ok.all()):
            raise KVMemoryError(f"head {h} does not hold every position asked for")
        if positions.numel() and not bool((have[idx] == positions).all()):
            raise KVMemoryError(f"head {h} does not hold every position asked for")
        return self.hk[h][idx], self.hv[h][idx], positions

    def head(self, h: int) -> HeadEntries:
        """Head ``h``'s used entries (ragged layout; views)."""
        if not self.ragged:
            raise KVMemoryError("head() reads the ragged layout")
        n = self.length[h]
        return HeadEntries(self.hk[h][:n], self.hv[h][:n], self.hpos[h][:n])

    def positions_in(self, h: int, start: int, stop: int) -> torch.Tensor:
        """Positions of head ``h`` within ``[start, stop)`` (ragged layout)."""
        pos = self.hpos[h][:self.length[h]]
        a = int(torch.searchsorted(pos, torch.tensor(start, device=pos.device)))
        b = int(torch.searchsorted(pos, torch.tensor(stop, device=pos.device)))
        return pos[a:b]

    def read_range(self, h: int, start: int, stop: int) -> HeadEntries:
        """Head ``h``'s entries with positions in ``[start, stop)`` (copies)."""
        if not self.ragged:
            assert self.k is not None and self.v is not None
            return HeadEntries(self.k[0, h, start:stop].clone(), self.v[0, h, start:stop].clone(),
                               torch.arange(start, stop, device=self.device))
        pos = self.hpos[h][:self.length[h]]
        a = int(torch.searchsorted(pos, torch.tensor(start, device=pos.device)))
        b = int(torch.searchsorted(pos, torch.tensor(stop, device=pos.device)))
        return HeadEntries(self.hk[h][a:b].clone(), self.hv[h][a:b].clone(), pos[a:b].clone())

    def remove_range(self, h: int, start: int, stop: int) -> int:
        """Drops head ``h``'s entries with positions in ``[start, stop)`` (ragged layout; the
        rest shifts down). Returns how many were dropped."""
        if not self.ragged:
            raise KVMemoryError("remove_range works on the ragged layout (compact first)")
        n = self.length[h]
        pos = self.hpos[h][:n]
        a = int(torch.searchsorted(pos, torch.tensor(start, device=pos.device)))
        b = int(torch.searchsorted(pos, torch.tensor(stop, device=pos.device)))
        if b > a:
            for t in (self.hk[h], self.hv[h], self.hpos[h]):
                t[a:n - (b - a)] = t[b:n].clone()
            self.length[h] = n - (b - a)
        return b - a

    def write_ragged(self, h0: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Heads ``h0 ..`` hold ``k``, ``v`` ``[heads, n, D]`` at positions ``start .. start+n``
        (ragged layout), in place of what they held there."""
        n = int(k.shape[1])
        pos = torch.arange(start, start + n, device=self.device)
        for x in range(int(k.shape[0])):
            self.remove_range(h0 + x, start, start + n)
            self.insert(h0 + x, HeadEntries(k[x], v[x], pos))

    def insert(self, h: int, entries: HeadEntries) -> None:
        """Adds entries to head ``h`` (ragged layout), keeping positions ascending; none of the
        positions may be present already."""
        if not self.ragged:
            raise KVMemoryError("insert works on the ragged layout")
        m = int(entries.pos.numel())
        if m == 0:
            return
        n = self.length[h]
        cap = int(self.hk[h].shape[0])
        if n + m > cap:
            self._regrow(h, _grow(cap, n + m))
        pos = self.hpos[h][:n]
        new_pos = entries.pos.to(torch.long)
        if n and bool(torch.isin(new_pos, pos).any()):
            raise KVMemoryError(f"head {h} already holds some of these positions")
        allp = torch.cat([pos, new_pos])
        order = torch.argsort(allp, stable=True)
        self.hk[h][:n + m] = torch.cat([self.hk[h][:n], entries.k.to(self.dtype)])[order]
        self.hv[h][:n + m] = torch.cat([self.hv[h][:n], entries.v.to(self.dtype)])[order]
        self.hpos[h][:n + m] = allp[order]
        self.length[h] = n + m

    def _regrow(self, h: int, cap: int) -> None:
        n = self.length[h]
        for name in ("hk", "hv", "hpos"):
            old = getattr(self, name)[h]
            new = torch.zeros((cap, *old.shape[1:]), dtype=old.dtype, device=old.device)
            new[:n] = old[:n]
            getattr(self, name)[h] = new

    def shrink(self) -> None:
        """Releases spare capacity (ragged layout: each head to its length)."""
        if self.ragged:
            for h in range(self.num_heads):
                if int(self.hk[h].shape[0]) > self.length[h]:
                    self._regrow(h, self.length[h])

    # ---- appends (decoding) ----------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """New entries ``[H, q, D]`` at ``positions`` ``[q]`` (ascending, after every held one),
        in place: a dense layer writes its slots, a ragged one each head's tail."""
        q = int(k.shape[1])
        if not self.ragged:
            start = int(positions[0])
            if int(positions[-1]) - start + 1 != q:
                raise KVMemoryError("dense appends need consecutive positions")
            self.write_dense(0, self.num_heads, start, k, v)
            return
        for h in range(self.num_heads):
            n = self.length[h]
            cap = int(self.hk[h].shape[0])
            if n + q > cap:
                self._regrow(h, _grow(cap, n + q))
            self.hk[h][n:n + q] = k[h]
            self.hv[h][n:n + q] = v[h]
            self.hpos[h][n:n + q] = positions
            self.length[h] = n + q
