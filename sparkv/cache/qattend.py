"""Attention that reads quantized resident entries where they lie (docs/kv-memory.md).

A per-chunk layer holds its chunks as :class:`~sparkv.cache.payload.ChunkPayload` objects, each at
its own level. :class:`QuantizedRows` gathers, once, *references* to the quantized payloads of a
layer (no copy: the same tensors the memory accounts for) and attends over them with a fused
numba kernel: per row it unpacks the codes (8, 4 or 2 bits) into 64 floats in registers and uses
the per-row scale and zero directly,

    q . k^ = scale_k * (q . c_k) + zero_k * sum(q)          sum_r w_r v^_r = sum_r (w_r scale_v) c_v + sum_r w_r zero_v

so the context is never expanded to floats. Work is split into runs of at most
:data:`RUN_ROWS` rows of one head (a chunk's head slice), run in parallel, each returning a partial
softmax (max, sum, weighted values), merged per head. Entries held in fp (a mixed layer, the
decode tail) are attended with torch (:func:`attend_entries`) and merged with
:func:`merge_partials` (log-sum-exp weights): the result equals dequantize-then-attend up to
float32 rounding (tested).

Shapes: ``q [1, Hq, nq, D]``, ``q_pos [nq]``; a :class:`Partial` is ``out [Hq, nq, D]`` (float32,
normalized) and ``lse [Hq, nq]`` (``-inf`` for a query that sees no entry).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numba as nb
import numpy as np
import torch

from sparkv.cache.levels import QuantizedTensor
from sparkv.cache.payload import ChunkPayload

#: most rows of one head in one parallel work item
RUN_ROWS = 256

# 2^(e - 25) for the 32 float16 exponents (e = 0: subnormal, handled as 2^-24)
_EXP2 = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)


@dataclass
class Partial:
    """Attention over part of the entries: ``out [Hq, nq, D]`` normalized, ``lse [Hq, nq]``."""

    out: torch.Tensor
    lse: torch.Tensor


@nb.njit(inline="always", boundscheck=False)
def _half(h, tab):  # pragma: no cover - numba
    """float16 bits (uint16) -> float32 (finite values: scales and zeros are)."""
    e = (h >> 10) & 31
    f = h & 1023
    mag = np.float32(f if e == 0 else f + 1024) * tab[e]
    return -mag if h >> 15 else mag


@nb.njit(inline="always", boundscheck=False, fastmath=True)
def _unpack(c, r, bits, cf):  # pragma: no cover - numba
    """Row ``r`` of packed codes ``c [R, W]`` -> ``cf [W * 8 / bits]`` float32, in *plane* order:
    the codes of bit plane ``j`` (bits ``j*bits ..`` of every byte) at ``j*W .. (j+1)*W``, so
    every loop is contiguous (the caller permutes the query and the output to match)."""
    w = c.shape[1]
    if bits == 8:
        for i in range(w):
            cf[i] = np.float32(np.int32(c[r, i]))
    else:
        mask = np.int32((1 << bits) - 1)
        for j in range(8 // bits):
            shift = np.int32(j * bits)
            for b in range(w):
                cf[j * w + b] = np.float32((np.int32(c[r, b]) >> shift) & mask)


@nb.njit(inline="always", boundscheck=False, fastmath=True)
def _tail_unit(q, mpos, tk, tv, tpos, perm, h, scale, u, pm, pl, pacc):  # pragma: no cover
    """Partial attention of KV head ``h`` over the fp tail ``tk``, ``tv [Hkv, n, D]`` in natural
    order, read through ``perm`` (slot -> value index, ``>= D`` for padding) into the plane order
    of ``q`` and ``pacc``."""
    m_rows, dim, n, d = q.shape[1], q.shape[2], tk.shape[1], tk.shape[2]
    s = np.empty((n, m_rows), dtype=np.float32)
    for j in range(n):
        for m in range(m_rows):
            acc = np.float32(0.0)
            for i in range(dim):
                p = perm[i]
                if p < d:
                    acc += q[h, m, i] * tk[h, j, p]
            s[j, m] = scale * acc if tpos[j] <= mpos[m] else -np.inf
    for m in range(m_rows):
        mx = -np.inf
        for j in range(n):
            mx = max(mx, s[j, m])
        tot = np.float32(0.0)
        for i in range(dim):
            pacc[u, m, i] = 0.0
        if mx > -np.inf:
            for j in range(n):
                w = np.exp(s[j, m] - mx)
                tot += w
                for i in range(dim):
                    p = perm[i]
                    if p < d:
                        pacc[u, m, i] += w * tv[h, j, p]
        pm[u, m] = mx
        pl[u, m] = tot


@nb.njit(nogil=True, cache=True, boundscheck=False, fastmath=True, parallel=True)
def _runs(q, qsum, mpos, kc, ks, kz, vc, vs, vz, pos, bits, run_chunk, run_head, run_start,
          run_len, scale, tab, tk, tv, tpos, perm, pm, pl, pacc):  # pragma: no cover - numba
    """Partial softmax attention of every run (see the module docstring), then of each KV
    head's fp tail ``tk``/``tv`` ``[Hkv, n, D]`` (natural order, read through ``perm``; units
    ``runs .. runs + Hkv``, when ``n``)."""
    m_rows = q.shape[1]
    dim = q.shape[2]
    n_runs = run_chunk.shape[0]
    n_tail = tk.shape[0] if tk.shape[1] > 0 else 0
    for u in nb.prange(n_runs + n_tail):
        if u >= n_runs:
            _tail_unit(q, mpos, tk, tv, tpos, perm, u - n_runs, scale, u, pm, pl, pacc)
            continue
        c, h, a, n = run_chunk[u], run_head[u], run_start[u], run_len[u]
        b = bits[c]
        kcc, kss, kzz, vcc, vss, vzz, pp = kc[c], ks[c], kz[c], vc[c], vs[c], vz[c], pos[c]
        s = np.empty((n, m_rows), dtype=np.float32)
        cf = np.empty(dim, dtype=np.float32)
        qh = q[h]
        for j in range(n):
            r = a + j
            _unpack(kcc, r, b, cf)
            sk = scale * _half(kss[r], tab)
            zk = scale * _half(kzz[r], tab)
            p = pp[r]
            for m in range(m_rows):
                acc = np.float32(0.0)
                for i in range(dim):
                    acc += qh[m, i] * cf[i]
                s[j, m] = sk * acc + zk * qsum[h, m] if p <= mpos[m] else -np.inf
        mx = np.full(m_rows, -np.inf, dtype=np.float32)
        for j in range(n):
            for m in range(m_rows):
                mx[m] = max(mx[m], s[j, m])
        tot = np.zeros(m_rows, dtype=np.float32)
        wz = np.zeros(m_rows, dtype=np.float32)
        acc2 = np.zeros((m_rows, dim), dtype=np.float32)
        for j in range(n):
            r = a + j
            _unpack(vcc, r, b, cf)
            sv = _half(vss[r], tab)
            zv = _half(vzz[r], tab)
            for m in range(m_rows):
                w = np.float32(0.0) if mx[m] == -np.inf else np.exp(s[j, m] - mx[m])
                tot[m] += w
                wz[m] += w * zv
                ws = w * sv
                for i in range(dim):
                    acc2[m, i] += ws * cf[i]
        for m in range(m_rows):
            pm[u, m] = mx[m]
            pl[u, m] = tot[m]
            for i in range(dim):
                pacc[u, m, i] = acc2[m, i] + wz[m]


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _merge_runs(run_head, pm, pl, pacc, perm, out, lse):  # pragma: no cover - numba
    """Per KV head, the runs' partials (plane order) -> normalized ``out [Hkv, M, D]`` in
    natural order (slot ``i`` is value ``perm[i]``; slots ``>= D`` are padding) and
    ``lse [Hkv, M]``."""
    hkv, m_rows, d = out.shape
    dim = pacc.shape[2]
    acc = np.empty(dim, dtype=np.float64)
    for h in range(hkv):
        for m in range(m_rows):
            mx = -np.inf
            for u in range(run_head.shape[0]):
                if run_head[u] == h and pm[u, m] > mx:
                    mx = pm[u, m]
            for i in range(d):
                out[h, m, i] = 0.0
            if mx == -np.inf:
                lse[h, m] = -np.inf
                continue
            tot = 0.0
            acc[:] = 0.0
            for u in range(run_head.shape[0]):
                if run_head[u] == h and pm[u, m] > -np.inf:
                    w = np.exp(pm[u, m] - mx)
                    tot += w * pl[u, m]
                    for i in range(dim):
                        acc[i] += w * pacc[u, m, i]
            for i in range(dim):
                if perm[i] < d:
                    out[h, m, perm[i]] = acc[i] / tot
            lse[h, m] = mx + np.log(tot)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def plane_order(dim: int, bits: int) -> torch.Tensor:
    """``perm [Dp]``: the value index of each slot of :func:`_unpack`'s plane order (``Dp`` =
    ``dim`` rounded up to whole bytes; slots past ``dim`` are padding)."""
    per = 8 // bits
    width = -(-dim // per)
    return torch.tensor([b * per + j for j in range(per) for b in range(width)])


class QuantizedRows:
    """The quantized entries of some chunk payloads of one layer, ready to attend (references,
    not copies: building it costs a pass over the chunk list, attending reads the codes).

    Args:
        payloads: chunk payloads all at one level, ``int8``/``int4``/``int2`` (fp payloads are
            refused: attend them with :func:`attend_entries`), each with ``counts`` per head of
            its group.
        head0: per payload, the model KV head of its first head (its group's first head).
        num_kv_heads: of the layer.
    """

    def __init__(self, payloads: Sequence[ChunkPayload], head0: Sequence[int],
                 num_kv_heads: int) -> None:
        if len(payloads) != len(head0):
            raise ValueError("one first head per payload")
        self.num_kv_heads = num_kv_heads
        lists = [nb.typed.List() for _ in range(7)]
        bits, runs = [], []
        for c, (p, h0) in enumerate(zip(payloads, head0)):
            if not isinstance(p.k, QuantizedTensor) or not isinstance(p.v, QuantizedTensor):
                raise ValueError(f"{p.cid} is at level {p.level}: not quantized")
            if p.level != payloads[0].level:
                raise ValueError(f"{p.cid} is at {p.level}, not {payloads[0].level}: one "
                                 "QuantizedRows per level")
            for lst, t in zip(lists, (p.k.codes, p.k.scale, p.k.zero, p.v.codes, p.v.scale,
                                      p.v.zero, p.pos)):
                arr = _np(t)
                lst.append(arr.view(np.uint16) if arr.dtype == np.float16 else arr)
            bits.append(p.k.bits)
            start = 0
            for i, n in enumerate(p.counts):
                for a in range(0, n, RUN_ROWS):
                    runs.append((c, h0 + i, start + a, min(RUN_ROWS, n - a)))
                start += n
        self._lists = lists
        first = payloads[0].k if payloads else None
        assert first is None or isinstance(first, QuantizedTensor)     # checked above
        self.dim = first.dim if first is not None else 0
        self.bits = first.bits if first is not None else 8
        self._perm = plane_order(self.dim, self.bits) if payloads else None
        self._perm_np = self._perm.numpy() if self._perm is not None else np.zeros(0, np.int64)
        self._slots = self._perm_np < self.dim         # the slots holding a value, not padding
        self._bits = np.array(bits, dtype=np.int32)
        r = np.array(runs, dtype=np.int32).reshape(-1, 4)
        self._run = [np.ascontiguousarray(r[:, i]) for i in range(4)]
        self.rows = int(r[:, 3].sum()) if len(runs) else 0

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float | None,
               tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Partial:
        """``q [1, Hq, nq, D]`` over these entries (query ``i`` sees positions ``<= q_pos[i]``)
        and, in the same kernel call, the fp ``tail`` ``(k [Hkv, n, D], v, pos [n])``."""
        _, hq, nq, d = q.shape
        hkv = self.num_kv_heads
        group = hq // hkv
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        qf = q[0].float().reshape(hkv, group * nq, d)
        m_rows = group * nq
        if not self.rows or self._perm is None:
            if tail is not None:
                return attend_stacked(q, *tail, q_pos, scale)
            return Partial(torch.zeros(hq, nq, d), torch.full((hq, nq), float("-inf")))
        dp = int(self._perm.numel())
        qnat = _np(qf)
        qsum = qnat.sum(-1)
        qn = np.zeros((hkv, m_rows, dp), dtype=np.float32)
        qn[:, :, self._slots] = qnat[:, :, self._perm_np[self._slots]]
        tk, tv, tpos = _tail_arrays(tail, hkv, d)
        mpos = np.tile(q_pos.to(torch.int64).cpu().numpy(), group)
        units = self._run[0].shape[0] + (hkv if tk.shape[1] else 0)
        pm = np.empty((units, m_rows), dtype=np.float32)
        pl = np.empty((units, m_rows), dtype=np.float32)
        pacc = np.empty((units, m_rows, dp), dtype=np.float32)
        k_c, k_s, k_z, v_c, v_s, v_z, pos = self._lists
        _runs(qn, qsum, mpos, k_c, k_s, k_z, v_c, v_s, v_z, pos,  # type: ignore[call-arg]
              self._bits, *self._run,           # (numba types a jitted function's call as no-args)
              np.float32(scale), _EXP2, tk, tv, tpos, self._perm_np, pm, pl, pacc)
        out = np.empty((hkv, m_rows, d), dtype=np.float32)
        lse = np.empty((hkv, m_rows), dtype=np.float32)
        heads = self._run[1] if units == self._run[1].shape[0] else \
            np.concatenate([self._run[1], np.arange(hkv, dtype=np.int32)])
        _merge_runs(heads, pm, pl, pacc, self._perm_np, out, lse)
        return Partial(torch.from_numpy(out).view(hq, nq, d), torch.from_numpy(lse).view(hq, nq))


def _tail_arrays(tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, hkv: int,
                 d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tail's K and V as float32 ``[Hkv, n, D]`` arrays (natural order: the kernel reads them
    through the plane permutation) and its positions."""
    if tail is None or tail[0].shape[1] == 0:
        z = np.zeros((hkv, 0, d), dtype=np.float32)
        return z, z, np.zeros(0, dtype=np.int64)
    k, v, pos = tail
    return (_np(k.float()), _np(v.float()), pos.to(torch.int64).cpu().numpy())


def attend_entries(q: torch.Tensor, heads: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]],
                   q_pos: torch.Tensor, scale: float | None) -> Partial:
    """``q [1, Hq, nq, D]`` over fp entries given per KV head as ``(k [n_h, D], v, pos [n_h])``
    (torch; for the decode tail and fp chunks of a mixed layer)."""
    _, hq, nq, d = q.shape
    group = hq // len(heads)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(hq, nq, d, device=q.device)
    lse = torch.full((hq, nq), float("-inf"), device=q.device)
    qp = q_pos.to(device=q.device, dtype=torch.long).view(1, -1, 1)
    for h, (k, v, pos) in enumerate(heads):
        if k.shape[0] == 0:
            continue
        qs = q[0, h * group:(h + 1) * group].float()                        # [G, nq, D]
        s = (qs @ k.float().T) * scale                                     # [G, nq, n]
        s = s.masked_fill(pos.to(torch.long).view(1, 1, -1) > qp, float("-inf"))
        lo = torch.logsumexp(s, dim=-1)                                    # [G, nq]
        w = torch.exp(s - torch.where(torch.isinf(lo), torch.zeros_like(lo), lo).unsqueeze(-1))
        out[h * group:(h + 1) * group] = w @ v.float()
        lse[h * group:(h + 1) * group] = lo
    return Partial(out, lse)


def attend_stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                   q_pos: torch.Tensor, scale: float | None) -> Partial:
    """``q [1, Hq, nq, D]`` over fp entries every KV head holds at the same positions:
    ``k``, ``v`` ``[Hkv, n, D]``, ``pos [n]`` (the decode tail: a few batched torch ops)."""
    _, hq, nq, d = q.shape
    hkv = int(k.shape[0])
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qs = q[0].float().reshape(hkv, group * nq, d)
    s = torch.bmm(qs, k.float().transpose(1, 2)) * scale                   # [Hkv, G*nq, n]
    hidden = pos.to(torch.long).view(1, 1, -1) > q_pos.to(torch.long).repeat(group).view(1, -1, 1)
    if bool(hidden.any()):
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                       # [Hkv, G*nq]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.bmm(torch.exp(s - safe.unsqueeze(-1)), v.float())
    return Partial(out.view(hq, nq, d), lse.view(hq, nq))


def merge_partials(parts: Sequence[Partial]) -> Partial:
    """Attention over the union of the parts' entries (log-sum-exp weights)."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([p.lse for p in parts])                              # [P, Hq, nq]
    top = lse.max(dim=0).values
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse - safe)                                              # [P, Hq, nq]
    tot = w.sum(dim=0)
    out = sum(p.out * w[i].unsqueeze(-1) for i, p in enumerate(parts))
    assert isinstance(out, torch.Tensor)
    out = torch.where(tot.unsqueeze(-1) > 0, out / tot.clamp_min(1e-30).unsqueeze(-1),
                      torch.zeros_like(out))
    return Partial(out, safe + torch.log(tot))


class DequantizedRows:
    """:class:`QuantizedRows`' contract on a device the numba kernel cannot read (a GPU): each
    call dequantizes the payloads on their device (a bandwidth-bound pass, no Python per row)
    and attends with torch. Nothing is cached, so the memory stays quantized between calls."""

    def __init__(self, payloads: Sequence[ChunkPayload], head0: Sequence[int],
                 num_kv_heads: int) -> None:
        if len(payloads) != len(head0):
            raise ValueError("one first head per payload")
        for p in payloads:
            if not isinstance(p.k, QuantizedTensor) or not isinstance(p.v, QuantizedTensor):
                raise ValueError(f"{p.cid} is at level {p.level}: not quantized")
        self.payloads, self.head0, self.num_kv_heads = list(payloads), list(head0), num_kv_heads

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float | None,
               tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Partial:
        """As :meth:`QuantizedRows.attend`, on ``q``'s device."""
        heads = entries_per_head(self.payloads, self.head0, self.num_kv_heads)
        parts = [attend_entries(q, heads, q_pos, scale)] if self.payloads else []
        if tail is not None and tail[0].shape[1]:
            parts.append(attend_stacked(q, *tail, q_pos, scale))
        if not parts:
            _, hq, nq, d = q.shape
            return Partial(torch.zeros(hq, nq, d, device=q.device),
                           torch.full((hq, nq), float("-inf"), device=q.device))
        return merge_partials(parts)


def entries_per_head(payloads: Sequence[ChunkPayload], head0: Sequence[int], num_kv_heads: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per KV head, the payloads' entries in fp (dequantized where quantized) as
    ``(k [n_h, D], v, pos [n_h])``, in payload order; a head with none gets empty tensors
    (:func:`attend_entries` skips it). ``head0``: each payload's first model KV head."""
    per: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [
        [] for _ in range(num_kv_heads)]
    for p, h0 in zip(payloads, head0):
        k, v = p.fp()
        for i, sl in enumerate(p.head_slices()):
            per[h0 + i].append((k[sl], v[sl], p.pos[sl].long()))
    empty = (torch.zeros(0, 1), torch.zeros(0, 1), torch.zeros(0, dtype=torch.long))
    return [(torch.cat([x[0] for x in hs]), torch.cat([x[1] for x in hs]),
             torch.cat([x[2] for x in hs])) if hs else empty for hs in per]


def rows_for(device: torch.device) -> type:
    """The quantized-rows reader for KV held on ``device``: the fused numba kernel on the CPU,
    dequantize-then-attend with torch elsewhere."""
    return QuantizedRows if device.type == "cpu" else DequantizedRows


class ResidentAttention:
    """Attention over one layer's resident entries as held: its quantized chunks read in place
    (one :class:`QuantizedRows` per level) and its fp chunks (per KV head ``(k, v, pos)``), plus an optional
    fp tail per call. What :meth:`ContextKV.resident_attention
    <sparkv.cache.memory.ContextKV.resident_attention>` builds and decoders call.
    """

    def __init__(self, rows: Sequence[QuantizedRows | DequantizedRows],
                 fp_heads: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None
                 ) -> None:
        self.rows = list(rows)
        self.fp_heads = fp_heads

    def attend(self, q: torch.Tensor, q_pos: torch.Tensor, scale: float | None,
               tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
        """``q [1, Hq, nq, D]`` -> ``[1, Hq, nq, D]`` in ``q``'s dtype; ``tail``: fp entries
        ``(k [Hkv, n, D], v, pos [n])`` every head holds (the decode tail), or ``None``."""
        parts = [r.attend(q, q_pos, scale, tail if i == 0 else None)
                 for i, r in enumerate(self.rows)]
        if self.fp_heads is not None:
            parts.append(attend_entries(q, self.fp_heads, q_pos, scale))
        if tail is not None and not self.rows:
            parts.append(attend_stacked(q, *tail, q_pos, scale))
        if not parts:
            return torch.zeros_like(q)
        return merge_partials(parts).out.unsqueeze(0).to(q.dtype)


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernel for every level: a benchmark calls it
    before timing."""
    from sparkv.cache.levels import quantize
    from sparkv.layout import KVChunkId

    for bits, level in ((8, "int8"), (4, "int4"), (2, "int2")):
        k = quantize(torch.randn(4, 64), bits)
        p = ChunkPayload(KVChunkId(0, 0, 0), level, [4], torch.arange(4, dtype=torch.int32), k, k)
        QuantizedRows([p], [0], 1).attend(torch.randn(1, 1, 1, 64), torch.tensor([4]), None)
