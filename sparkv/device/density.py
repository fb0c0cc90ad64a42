"""Tolerance to compression: information density per chunk, and the level mix it chooses.

**Density** (LLMS eq. 1). For a context's attention matrices ``A^{l,h}`` (softmax over causally
visible keys), a token's density is the average of its column over the rows that can see it,
averaged over heads and layers; a chunk's density is the mean over its tokens::

    D_i = 1/(q-p) sum_{col=p..q} 1/L sum_l 1/H sum_h ( 1/(R-col) sum_{row>=col} A^{l,h}[row, col] )

The service measures it on the forward passes that make the chunks (the system prompt's prefill,
each call's prompt prefill and every decoded token): a forward hook on every attention module
takes the queries the module attended with (the fast attention forward offers them,
:data:`~sparkv.runtime.hooks.QUERY_SINK`; else it projects the module's own input again:
``q_proj``, Qwen3's ``q_norm``, RoPE with the module's ``position_embeddings``), the keys the layer
attended over from its cache (a fork's prefix and tail as two views), and adds the head-averaged
column sums and the number of rows that saw each column to a :class:`DensityRecorder`. Rows keep
arriving with later calls (a chunk is attended by every later prompt), so a token's density is
the column average over every row that has seen it so far.

**What it costs a call.** A pass of at most :attr:`DensityRecorder.DEFER_ROWS` rows (a
question's, a decoded token's) only keeps its queries; the recording's end (after the answer)
sums every layer's kept rows over the keys the cache then holds, as many layers and rows in one
softmax as fit a cache-sized block. A decoded token then costs a reference to its queries
(scaled once at the end), its keys counted and not viewed, not a product over the whole
context per layer, and the answer's first token waits for none of it. A pass over a fork whose
attention makes its softmax weights (:class:`~sparkv.cache.qattend.PrefixAttention`) hands them
to the recording thread's column sink (:mod:`sparkv.cache.colmass`): their column sums are
kept and summed at the end (:meth:`DensityRecorder.take`), and nothing is multiplied again:
``bench/density_tax.py``, docs/device-service.md ("Measuring the densities").

**Levels** (LLMS eq. 2-3). Chunks are ranked by density and cut by thresholds into ``int8`` /
``int4`` / ``int2`` (ratios 1, 1/2, 1/4 of the int8 base) so that the mix meets the global ratio
``ratio_global`` (the OS's knob). The paper weights chunks by ``1/ratio_w`` in the objective, which
read literally gives the *densest* chunks the *fewest* bits, and maximising ``sum bits * D`` under
the ratio constraint always ends at the two extreme levels (1/3 at int8 and 2/3 at int2 for 50%,
whatever the densities). [inferred] We minimise the density-weighted quantization error instead,
``sum_i D_i * step(level_i)^2`` with ``step = 1 / (2^bits - 1)`` (the relative quantization step
of :mod:`sparkv.cache.levels`; squared: the power of the rounding noise), subject to
``sum_i ratio(level_i) <= ratio_global * n``: the densest chunks keep the most bits, a chunk
drops to int2 only when its density is far below the int8 chunks' (the exchange rate of the
squared steps: one int8 and two int2 chunks for three int4 ones pays when the int8 chunk is
about 50 times denser), and the mix follows the densities. The step itself (unsquared) priced
int2 about 5x int4 and put 10-16 of 96-128 chunks at int2 at ratio 0.5: a continuation's
perplexity after the context rose 17-26% where every chunk at int4 (the same bytes) left it
within 1%; squared, 2 chunks go to int2 and it rises 1-3% (``bench/llms_perplexity.py``, three
texts, docs/device-service.md). The optimum over the sorted densities is found exactly by
enumerating the int8 count (``O(n)`` with prefix sums).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from sparkv.cache.colmass import set_sink
from sparkv.cache.levels import SIDE_BITS
from sparkv.runtime.fastops import apply_rope
from sparkv.runtime.hfcache import hook_cache
from sparkv.runtime.hooks import QUERY_SINK, rows_safe

#: the quantized levels the planner mixes, from the most bits down
LADDER = ("int8", "k8v4", "int4", "int2")
#: the ladder before k8v4 (quality table entries without a ``ladder`` were measured with it)
OLD_LADDER = ("int8", "int4", "int2")
#: ratio of each level's bits to the int8 base (the paper's {8/8, 4/8, 2/8}; k8v4: (8 + 4) / 16)
LEVEL_RATIO = {"int8": 1.0, "k8v4": 0.75, "int4": 0.5, "int2": 0.25}  # fp: its real bytes
#: relative quantization step of each level, of K and of V (``1 / (2^bits - 1)``; fp: 0)
SIDE_STEP = {"fp": (0.0, 0.0), **{lv: (1 / ((1 << kb) - 1), 1 / ((1 << vb) - 1))
                                  for lv, (kb, vb) in SIDE_BITS.items()}}
#: relative quantization step of each level (the larger side's)
LEVEL_STEP = {lv: max(st) for lv, st in SIDE_STEP.items()}
#: the share of the keys in a level's error: a screen of the quality table's QA questions
#: (``bench/kv_int4_study.py``, SmolLM2) lost 0.055 over int8 with K alone at int4 and 0.011
#: with V alone at int4 (0.058 with both): the keys carry 5/6 of it
K_SHARE = 0.83
#: each level's error weight in the planner (what a density is weighted by): its steps squared,
#: the power of its rounding noise, K's and V's by their shares (module docstring, "Levels");
#: a uniform level's is its step squared
LEVEL_ERROR = {lv: K_SHARE * k * k + (1 - K_SHARE) * v * v for lv, (k, v) in SIDE_STEP.items()}


def ladder_key(ladder: Sequence[str] = LADDER) -> str:
    """``ladder`` as the quality table records it (a device entry's ``params["ladder"]``)."""
    return ",".join(ladder)


class DensityRecorder:
    """Column sums of attention for one forward pass (or one call's passes).

    Attributes:
        mass: ``float64[positions]``: per key position, the sum over rows and layers of the
            head-averaged attention it received.
        rows: ``float64[positions]``: per key position, the number of (row, layer) pairs that
            saw it.
    """

    #: a hook call of at most this many rows (a question's, a decoded token's) waits for
    #: :meth:`flush` (the end of the recording: after the answer's first token)
    DEFER_ROWS = 256
    #: a layer's waiting queries are summed once they hold this many bytes (bounded memory:
    #: SmolLM2's 900 rows, an 8B model's 128)
    FLUSH_BYTES = 1 << 21
    #: a pass whose attention hands over its weights (:mod:`~sparkv.cache.colmass`: a fork over
    #: a dense arena) adds their column sums (:meth:`take`), no second product of its queries
    TAKE_WEIGHTS = True

    def __init__(self, positions: int = 0) -> None:
        self.mass = torch.zeros(positions, dtype=torch.float64)
        self.rows = torch.zeros(positions, dtype=torch.float64)
        self.calls = 0
        self._waiting: dict[int, _Rows] = {}
        self._columns = _Columns()

    def _grow(self, n: int) -> None:
        if n > self.mass.numel():
            extra = n - self.mass.numel()
            self.mass = torch.cat([self.mass, torch.zeros(extra, dtype=torch.float64)])
            self.rows = torch.cat([self.rows, torch.zeros(extra, dtype=torch.float64)])

    def add(self, colsum: torch.Tensor, rows: torch.Tensor) -> None:
        """Adds one layer's head-averaged column sums and row counts (``[S]`` each)."""
        s = int(colsum.numel())
        self._grow(s)
        self.mass[:s] += colsum.to("cpu", torch.float64)      # a GPU's sums come back once
        self.rows[:s] += rows.to("cpu", torch.float64)
        self.calls += 1

    def defer(self, layer: int, cache: Any, q: torch.Tensor, scale: float, first: int) -> None:
        """Keeps layer ``layer``'s rows (queries ``[1, Hq, n, D]``, to be multiplied by ``scale``,
        at positions ``first`` to ``first + n - 1``) to be summed with the layer's later rows
        over the keys ``cache`` then holds: a decoded token's column sums cost one key product
        per layer and answer, not one per token, and its hook call keeps a reference and two
        numbers (no tensor made)."""
        w = self._waiting.get(layer)
        if w is not None and (w.cache is not cache or w.scale != scale):
            self._flush_layer(layer)
            w = None
        if w is None:
            w = self._waiting[layer] = _Rows(cache, scale)
        w.keep(q, first)
        if w.nbytes >= self.FLUSH_BYTES:
            self._flush_layer(layer)

    def take(self, colsum: torch.Tensor, heads: int, first: int, n: int) -> None:
        """Adds a pass's column sums of its attention weights over ``heads`` query heads
        (``[s]``, what the layer's attention computed anyway) for its ``n`` rows at positions
        ``first`` on: kept by reference, summed at :meth:`flush` (or once the kept sums hold
        :attr:`FLUSH_BYTES`) with their row counts."""
        self._columns.add(colsum, heads, first, n, self.FLUSH_BYTES)

    def flush(self) -> None:
        """Sums every waiting row (:meth:`defer`) into :attr:`mass` and :attr:`rows`: the
        layers whose rows sit at the same positions over as many keys in one softmax; then the
        taken column sums (:meth:`take`)."""
        groups: dict[tuple[int, tuple[tuple[int, int], ...]],
                     list[tuple[_Rows, list[torch.Tensor]]]] = {}
        for layer, w in self._waiting.items():
            parts = _key_parts(w.cache, layer)
            if parts:
                s = sum(int(p.shape[1]) for p in parts)
                groups.setdefault((s, tuple(w.spans)), []).append((w, parts))
        self._waiting.clear()
        with torch.no_grad():
            for (s, spans), layers in groups.items():
                pos = torch.cat([torch.arange(a, a + k) for a, k in spans])
                q = torch.stack([w.queries() for w, _ in layers])
                mass = _column_mass(q, [parts for _, parts in layers], pos, s)
                self.add(mass, _seen_by(pos, s) * len(layers))
        if self._columns.spans:
            self.add(*self._columns.pop())

    def drop_waiting(self) -> None:
        """Forgets the waiting rows and taken column sums (their pass failed)."""
        self._waiting.clear()
        self._columns = _Columns()

    def _flush_layer(self, layer: int) -> None:
        rows = self._waiting.pop(layer)
        self._waiting, others = {layer: rows}, self._waiting
        try:
            self.flush()
        finally:
            self._waiting = others

    def add_matrix(self, attn: torch.Tensor, q_pos: torch.Tensor, num_keys: int) -> None:
        """One layer's attention ``[H, q, S]`` (rows sum to 1 over visible keys)."""
        colsum = attn.float().sum(dim=(0, 1)) / attn.shape[0]
        kpos = torch.arange(num_keys, device=attn.device)
        rows = (kpos.view(1, -1) <= q_pos.view(-1, 1).to(attn.device)).sum(0)
        self.add(colsum[:num_keys], rows)


class _Rows:
    """A layer's rows waiting to be summed (:meth:`DensityRecorder.defer`): their queries (not
    yet scaled) and their positions as spans ``(first, rows)`` (a decoded token's joins the
    span before it), over ``cache``'s keys."""

    def __init__(self, cache: Any, scale: float) -> None:
        self.cache, self.scale = cache, scale
        self.q: list[torch.Tensor] = []
        self.spans: list[tuple[int, int]] = []
        self.nbytes = 0

    def keep(self, q: torch.Tensor, first: int) -> None:
        """Adds the rows ``q`` (``[1, Hq, n, D]``) at positions ``first`` on."""
        n = int(q.shape[2])
        self.q.append(q)
        if self.spans and sum(self.spans[-1]) == first:
            self.spans[-1] = (self.spans[-1][0], self.spans[-1][1] + n)
        else:
            self.spans.append((first, n))
        self.nbytes += q.numel() * q.element_size()

    def queries(self) -> torch.Tensor:
        """The rows' queries ``[Hq, n, D]``, scaled (a new tensor)."""
        q = self.q[0] if len(self.q) == 1 else torch.cat(self.q, dim=2)
        return q[0] * self.scale


class _Columns:
    """Column sums taken from the attention (:meth:`DensityRecorder.take`): kept by reference
    (a hook call appends one; an add of its own took ~45 us more a call in a forward) and
    summed in groups of one length and head count (a stack and a sum each) into one float64
    vector on their device at :meth:`pop`, or once they hold ``limit`` bytes; and the row spans
    ``(first, rows, keys)`` that made them, counted."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, int]] = []
        self.nbytes = 0
        self.sums: torch.Tensor | None = None
        self.size = 0
        self.spans: Counter[tuple[int, int, int]] = Counter()

    def add(self, colsum: torch.Tensor, heads: int, first: int, n: int, limit: int) -> None:
        """Keeps ``colsum / heads`` (``[s]``) for ``n`` rows at positions ``first`` on."""
        s = int(colsum.numel())
        self.kept.append((colsum, heads))
        self.nbytes += s * colsum.element_size()
        self.size = max(self.size, s)
        self.spans[(first, n, s)] += 1
        if self.nbytes >= limit:
            self._fold()

    def _fold(self) -> None:
        """Sums the kept column sums into :attr:`sums`."""
        groups: dict[tuple[int, int], list[torch.Tensor]] = {}
        for colsum, heads in self.kept:
            groups.setdefault((int(colsum.numel()), heads), []).append(colsum)
        if not groups:
            return
        have = 0 if self.sums is None else int(self.sums.numel())
        if have < self.size:
            grown = torch.zeros(self.size, dtype=torch.float64, device=self.kept[0][0].device)
            if self.sums is not None:
                grown[:have] = self.sums
            self.sums = grown
        assert self.sums is not None
        for (s, heads), sums in groups.items():
            total = sums[0] if len(sums) == 1 else torch.stack(sums).sum(0)
            self.sums[:s].add_(total, alpha=1.0 / heads)
        self.kept, self.nbytes = [], 0

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed mass and the rows that saw each key (``[size]`` each); then empty."""
        self._fold()
        assert self.sums is not None
        rows = torch.zeros(self.size, dtype=torch.float64)
        for (first, n, s), count in self.spans.items():
            if n == 1:                          # a decoded token sees every key up to itself
                rows[:min(s, first + 1)] += count
            else:
                rows[:s] += _seen_by(torch.arange(first, first + n), s) * count
        mass = self.sums[:self.size]
        self.sums, self.size, self.spans = None, 0, Counter()
        return mass, rows


_active = threading.local()


class recording:
    """``with recording(recorder): model(...)``: the attention hooks of this thread add to
    ``recorder`` (no-op elsewhere)."""

    def __init__(self, recorder: DensityRecorder | None) -> None:
        self.recorder = recorder
        self._prev: DensityRecorder | None = None
        self._prev_sink: Any = None

    def __enter__(self) -> DensityRecorder | None:
        self._prev = getattr(_active, "recorder", None)
        _active.recorder = self.recorder
        _active.columns = None
        takes = self.recorder is not None and self.recorder.TAKE_WEIGHTS
        self._prev_sink = set_sink(_offered_sums if takes else None)
        return self.recorder

    def __exit__(self, kind: object, *exc: object) -> None:
        _active.recorder = self._prev
        _active.columns = None
        set_sink(self._prev_sink)
        if self.recorder is not None:   # the caches the rows read are still alive here
            if kind is None:
                self.recorder.flush()
            else:
                self.recorder.drop_waiting()


def _key_parts(cache: Any, layer_idx: int) -> list[torch.Tensor] | None:
    """The dense keys the layer just attended over, as pieces ``[Hkv, s_i, D]`` that make the
    keys by slot (= position) when joined: a fork's prefix and tail stay two views."""
    if cache is None:
        return None
    keys = getattr(cache, "density_keys", None)
    if keys is not None:
        return [keys[0]]
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    parts = getattr(layers[layer_idx], "key_parts", None)
    if callable(parts):
        got: list[torch.Tensor] | None = parts()
        return got
    k = getattr(layers[layer_idx], "keys", None)
    if isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[2] > 0:
        return [k[0]]
    return None


def _offered(module: torch.nn.Module, q: torch.Tensor) -> None:
    """The attention modules' :data:`~sparkv.runtime.hooks.QUERY_SINK`: on a recording thread,
    keeps the queries the module attends with for its density hook."""
    if getattr(_active, "recorder", None) is not None:
        _active.offered = (module, q)


def _offered_sums(colsum: torch.Tensor, pairs: int) -> None:
    """A recording thread's column sink (:mod:`~sparkv.cache.colmass`): keeps the column sums
    ``[keys]`` of the weights a layer's attention just made, and how many (head, row) pairs
    they sum, for the layer's density hook."""
    _active.columns = (colsum, pairs)


def _queries(module: torch.nn.Module, hidden: torch.Tensor, pe: Any, d: int,
             offered: Any) -> torch.Tensor:
    """The layer's queries ``[1, Hq, n, D]`` of ``hidden [1, n, d_model]``, not scaled: those its
    forward ``offered`` (:func:`_offered`: a tensor of that forward's own, which nothing
    writes to later), else projected, normed and rotated again as the module does."""
    if offered is not None and offered[0] is module and offered[1].shape[0] == 1 \
            and offered[1].shape[2] == hidden.shape[1]:
        kept: torch.Tensor = offered[1]
        return kept
    with torch.no_grad():
        q = module.get_submodule("q_proj")(hidden).view(*hidden.shape[:2], -1, d)
        q_norm = getattr(module, "q_norm", None)
        if q_norm is not None:  # Qwen3
            q = q_norm(q)
        return apply_rope(q.transpose(1, 2), *pe)


#: elements of the largest ``[layers, H, rows, keys]`` score block (4 MB in fp32: it stays in
#: the caches; a decoded token's rows of every layer of a 2K context fit in one)
_BLOCK_ELEMENTS = 1 << 20


def _column_mass(q: torch.Tensor, parts: list[list[torch.Tensor]], q_pos: torch.Tensor,
                 s: int) -> torch.Tensor:
    """The column sums ``float64[s]``, head-averaged and summed over layers, of the causal
    softmax of each layer's queries ``q[l]`` (``[L, Hq, n, D]``, scaled) over its keys
    ``parts[l]``; the rows at positions ``q_pos`` (CPU). A query head reads its group's key head
    (no repeated keys); keys no row of a block sees are left out; as many layers and rows at
    once as :data:`_BLOCK_ELEMENTS` allows."""
    nl, hq, n, _ = q.shape
    parts = [[p.to(q.dtype) for p in ps] for ps in parts]
    colsum = torch.zeros(s, dtype=torch.float64, device=q.device)
    step = max(1, min(256, _BLOCK_ELEMENTS // (hq * max(s, 1))))
    for a in range(0, n, step):
        rows = q_pos[a:a + step]
        m = min(s, int(rows.max()) + 1)
        group = max(1, _BLOCK_ELEMENTS // (hq * int(rows.numel()) * m))
        for i in range(0, nl, group):
            colsum[:m] += _block_mass(q[i:i + group, :, a:a + step], parts[i:i + group], rows, m)
    return colsum / hq


def _block_mass(q: torch.Tensor, parts: list[list[torch.Tensor]], rows: torch.Tensor,
                m: int) -> torch.Tensor:
    """The column sums ``float64[m]`` over layers and heads of the softmax of queries ``q``
    (``[L, Hq, r, D]``, the rows at positions ``rows``) over the first ``m`` keys of each
    layer's ``parts``. Each layer's scores are joined straight into one block (one copy, not a
    join and a stack), and only the columns past the lowest row are masked: every row sees the
    keys below it."""
    nl, hq, r, d = q.shape
    hkv = int(parts[0][0].shape[0])
    g = hq // hkv
    scores = torch.empty(nl, hkv, g * r, m, dtype=q.dtype, device=q.device)
    for i in range(nl):
        _scores_into(scores[i], q[i].reshape(hkv, g * r, d), parts[i])
    lo = int(rows.min()) + 1
    if lo < m:                      # some row does not see every key below m
        kpos = torch.arange(lo, m, device=q.device)
        hidden = kpos.view(1, -1) > rows.to(q.device).view(-1, 1)
        scores.view(nl, hkv, g, r, m)[..., lo:].masked_fill_(hidden, float("-inf"))
    attn = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return attn.view(-1, m).sum(0).to(torch.float64)


def _scores_into(out: torch.Tensor, q: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Writes ``q @ K^T`` (``[Hkv, rows, m]``, contiguous) into ``out`` over the first ``m``
    keys of ``parts``: one piece's product straight into it, several pieces' products joined
    into it (a product written into a column slice of ``out`` went through a copy of its own
    and ran slower)."""
    keys, start, m = [], 0, int(out.shape[-1])
    for p in parts:
        take = min(int(p.shape[1]), m - start)
        if take <= 0:
            break
        keys.append(p[:, :take].transpose(1, 2))
        start += take
    if len(keys) == 1:
        torch.matmul(q, keys[0], out=out)
    else:
        torch.cat([torch.matmul(q, k) for k in keys], dim=-1, out=out)


def _seen_by(q_pos: torch.Tensor, s: int) -> torch.Tensor:
    """Per key position below ``s``, how many of the rows at ``q_pos`` see it (``pos >=
    key``)."""
    ordered = q_pos.sort().values
    return int(q_pos.numel()) - torch.searchsorted(ordered, torch.arange(s))


@rows_safe   # a no-op on every thread but a recording one (batched steps never record)
def _attention_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    rec = getattr(_active, "recorder", None)
    if rec is None:
        return
    offered, _active.offered = getattr(_active, "offered", None), None
    columns, _active.columns = getattr(_active, "columns", None), None
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    pe = kwargs.get("position_embeddings")
    cache = hook_cache(kwargs)
    layer = int(getattr(module, "layer_idx", 0) or 0)
    if hidden is None or pe is None:
        return
    n = int(hidden.shape[1])
    if columns is not None and hidden.shape[0] == 1 and _take(rec, columns, cache, layer, n):
        return
    if n <= rec.DEFER_ROWS and getattr(cache, "density_keys", None) is None:
        s = _key_count(cache, layer)        # no tensor made, so no grad mode to enter (~30 us)
        if s:
            q = _queries(module, hidden, pe, _head_dim(module, cache, layer), offered)
            rec.defer(layer, cache, q, _scale(module, q), s - n)
        return
    parts = _key_parts(cache, layer)
    if not parts:
        return
    with torch.no_grad():
        s = sum(int(p.shape[1]) for p in parts)
        q_pos = getattr(cache, "density_q_pos", None)
        q_pos = torch.arange(s - n, s) if q_pos is None else q_pos.to(torch.long).cpu()
        q = _queries(module, hidden, pe, int(parts[0].shape[-1]), offered)
        rec.add(_column_mass(q * _scale(module, q), [parts], q_pos, s), _seen_by(q_pos, s))


def _take(rec: DensityRecorder, columns: tuple[torch.Tensor, int], cache: Any, layer: int,
          n: int) -> bool:
    """Takes the column sums the layer's attention offered (:func:`_offered_sums`) for its
    ``n`` rows, the last ones of the keys the layer holds, where they are the whole pass's over
    those keys; returns whether it did (else the hook sums the pass itself)."""
    colsum, pairs = columns
    if getattr(cache, "density_keys", None) is not None or pairs % n:
        return False
    s = _key_count(cache, layer)
    if not s or int(colsum.numel()) != s:
        return False
    rec.take(colsum, pairs // n, s - n, n)
    return True


def _key_count(cache: Any, layer_idx: int) -> int | None:
    """How many keys :func:`_key_parts` gives (``None`` where it gives none), without making
    them where the layer tells (a fork's ``key_count``, a cache layer's ``keys`` tensor)."""
    layers = getattr(cache, "layers", None)
    if getattr(cache, "density_keys", None) is None and layers is not None \
            and 0 <= layer_idx < len(layers):
        layer = layers[layer_idx]
        count = getattr(layer, "key_count", None)
        if callable(count):
            got: int | None = count()
            return got
        k = getattr(layer, "keys", None)
        if not callable(getattr(layer, "key_parts", None)) and isinstance(k, torch.Tensor) \
                and k.dim() == 4:
            return int(k.shape[2]) or None
    parts = _key_parts(cache, layer_idx)
    return None if not parts else sum(int(p.shape[1]) for p in parts)


def _head_dim(module: torch.nn.Module, cache: Any, layer_idx: int) -> int:
    """The module's head dimension (else its keys')."""
    d = getattr(module, "head_dim", None)
    if d is not None:
        return int(d)
    parts = _key_parts(cache, layer_idx)
    assert parts
    return int(parts[0].shape[-1])


def _scale(module: torch.nn.Module, q: torch.Tensor) -> float:
    """The module's score scale (``1 / sqrt(D)`` unless it names its own)."""
    return float(getattr(module, "scaling", int(q.shape[-1]) ** -0.5))


_HOOKED: dict[int, list[Any]] = {}


def install_hooks(model: torch.nn.Module) -> int:
    """Puts the density hook on every attention module of ``model`` (once per model); returns
    how many modules carry it. The hooks do nothing unless a :class:`recording` is active in
    the calling thread."""
    key = id(model)
    if key in _HOOKED:
        return len(_HOOKED[key])
    handles = []
    for name, mod in model.named_modules():
        if name.endswith("self_attn") and hasattr(mod, "q_proj"):
            handles.append(mod.register_forward_hook(_attention_hook, with_kwargs=True))
            setattr(mod, QUERY_SINK, _offered)
    _HOOKED[key] = handles
    return len(handles)


def chunk_densities(mass: torch.Tensor, rows: torch.Tensor, chunk_tokens: int,
                    num_tokens: int | None = None) -> np.ndarray:
    """Per token chunk, the mean over its tokens of ``mass / rows`` (0 where never seen)."""
    n = int(mass.numel()) if num_tokens is None else int(num_tokens)
    m = mass[:n].double()
    r = rows[:n].double()
    tok = torch.where(r > 0, m / r.clamp_min(1.0), torch.zeros_like(m)).cpu().numpy()
    nt = -(-n // chunk_tokens)
    out = np.zeros(nt)
    for t in range(nt):
        out[t] = float(tok[t * chunk_tokens:(t + 1) * chunk_tokens].mean())
    return out


@dataclass(frozen=True)
class LevelMix:
    """The level of every chunk and the mix it makes."""

    levels: tuple[str, ...]
    ratio: float              # achieved bytes / int8 bytes
    error: float              # sum of density * error weight (LEVEL_ERROR)

    def counts(self) -> dict[str, int]:
        return {lv: sum(1 for x in self.levels if x == lv) for lv in ("fp",) + LADDER}


def _ladder_mix(ds: np.ndarray, budget: float, st: dict[str, float],
                ladder: Sequence[str] = LADDER) -> tuple[float, list[int]]:
    """The best ``(error, chunks per level of ladder)`` for densities ``ds`` sorted descending
    within ``budget`` int8 units: the densest chunks on the ladder's top level, the next on its
    middle one (if any), then its last two (as many on the upper of them as the budget allows:
    with densities sorted, fewer never helps). With a middle level, the last two are used only
    when the top and middle ones cannot meet the budget. Exact: every count of the top and
    middle levels is tried (``O(n^2)`` array work with a middle level)."""
    if len(ladder) not in (3, 4):
        raise ValueError(f"a ladder of 3 or 4 levels, not {ladder}")
    top, low, last = ladder[0], ladder[-2], ladder[-1]
    mid = ladder[1] if len(ladder) == 4 else None
    r, n = LEVEL_RATIO, len(ds)
    pre = np.concatenate([[0.0], np.cumsum(ds)])
    if mid and budget >= n * r[mid] - 1e-9:
        # the top and middle levels meet it: nothing lower (K's int4 fails the QA rule in any
        # chunk the densities pick; K at int8 passes in 3 chunks of 4: docs/device-service.md)
        n8 = int(min(n, np.floor((budget - n * r[mid]) / (r[top] - r[mid]) + 1e-9)))
        return float(pre[n8] * st[top] + (pre[n] - pre[n8]) * st[mid]), [n8, n - n8, 0, 0]
    best: tuple[float, list[int]] | None = None
    for n8 in range(n + 1):
        rest = n - n8
        if n8 * r[top] + rest * r[last] > budget + 1e-9:
            break
        nm = np.arange(rest + 1) if mid else np.zeros(1, dtype=np.int64)
        left = rest - nm
        room = (budget - n8 * r[top] - nm * (r[mid] if mid else 0.0) - left * r[last]) \
            / (r[low] - r[last])
        n4 = np.minimum(left, np.floor(np.maximum(room, 0.0) + 1e-9)).astype(np.int64)
        b, c = n8 + nm, n8 + nm + n4
        err = (pre[n8] * st[top] + (pre[b] - pre[n8]) * (st[mid] if mid else 0.0)
               + (pre[c] - pre[b]) * st[low] + (pre[n] - pre[c]) * st[last])
        err = np.where(room >= -1e-9, err, np.inf)
        # a tie goes to more of the upper levels: chunks of density 0 (never attended yet)
        # cost no error at any level, and the budget they leave unused would otherwise put
        # them lower even at ratio 1.0, which promises every chunk at int8
        j = int(np.flatnonzero(err <= err.min() + 1e-15)[-1])
        if best is None or err[j] <= best[0] + 1e-15:
            counts = [n8] + ([int(nm[j])] if mid else []) + [int(n4[j]), rest - int(nm[j] + n4[j])]
            best = (float(err[j]), counts)
    if best is None:
        return float(pre[n] * st[last]), [0] * (len(ladder) - 1) + [n]
    return best


def plan_levels(densities: Sequence[float] | np.ndarray, ratio_global: float = 0.5,
                weights: dict[str, float] | None = None, *, fp_fraction: float = 0.0,
                protect: Sequence[int] = (), fp_ratio: float = 4.0,
                ladder: Sequence[str] = LADDER) -> LevelMix:
    """Levels for chunks of the given densities meeting ``ratio_global`` (module docstring).

    ``ratio_global`` is the target bytes relative to holding every chunk at int8: 1.0 keeps
    every chunk at int8 (whatever the densities, zeros included), 0.25 puts every chunk at
    int2. The densest chunks keep the most bits; among mixes of equal error, the one with the
    most bits. ``ladder``: the quantized levels mixed, from the most bits down
    (:data:`LADDER`; :data:`OLD_LADDER` without k8v4).

    **fp** (raw) chunks: the ``protect``-ed chunks (indices: the service protects the first
    chunk, whose keys are the attention sinks) and the densest ``fp_fraction`` of the others are
    kept unquantized; each costs ``fp_ratio`` int8 units (its real bytes relative to int8: about
    4 for fp32, 2 for fp16/bf16) out of the same budget ``ratio_global * n``, and the remaining
    chunks share what is left by the error-minimising mix of the ladder. When the budget cannot
    pay for them (every other chunk at int2 still over it), fp chunks are given up, least dense
    first, protected ones last.
    """
    d = np.asarray(list(densities), dtype=np.float64)
    n = len(d)
    if n == 0:
        return LevelMix((), 0.0, 0.0)
    r = float(max(ratio_global, LEVEL_RATIO[ladder[-1]]))
    st = weights or LEVEL_ERROR
    prot = [int(i) for i in dict.fromkeys(protect) if 0 <= int(i) < n]
    m = n - len(prot)
    budget = r * m + 1e-9
    order_all = [int(i) for i in np.argsort(-d, kind="stable")]
    extra = int(math.ceil(max(0.0, fp_fraction) * m - 1e-9))
    fp = [i for i in order_all if i not in prot][:extra]
    while fp and len(fp) * fp_ratio + LEVEL_RATIO[ladder[-1]] * (m - len(fp)) > budget:
        fp.pop()                     # the least dense first
    fp_set = set(fp) | set(prot)
    rest = np.array([i for i in order_all if i not in fp_set], dtype=np.int64)
    ds = d[rest] if len(rest) else np.zeros(0)
    err, counts = _ladder_mix(ds, min(budget - len(fp) * fp_ratio, float(len(rest))) + 1e-9, st,
                              ladder)
    if counts[0] == len(rest) and len(rest):
        # a budget beyond int8 for everything (ratio > 1): the densest int8 chunks go to fp
        left = budget - len(fp) * fp_ratio - len(rest)
        k = int(min(len(rest), max(0.0, np.floor(left / max(fp_ratio - 1.0, 1e-9) + 1e-9))))
        if k:
            rest = rest[k:]
            counts[0] = len(rest)
            err = float(d[rest].sum() * st[ladder[0]]) if len(rest) else 0.0
    levels = ["fp"] * n
    rank_level = np.repeat(np.arange(len(ladder)), counts)
    for rank, i in enumerate(rest):
        levels[int(i)] = ladder[int(rank_level[rank])]
    nfp = n - len(rest)
    ratio = (nfp * fp_ratio + sum(c * LEVEL_RATIO[lv] for c, lv in zip(counts, ladder))) / n
    return LevelMix(tuple(levels), ratio, float(err))
