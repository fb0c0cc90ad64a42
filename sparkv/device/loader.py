"""Loading a context for a call: the working memory, chunk recomputation at global positions, and
the IO-recompute pipeline (LLMS section 3.3).

A context's long-lived memory ``C`` is a paged :class:`~sparkv.cache.ContextKV` (each chunk at
its own level, on flash, or absent). A call runs over a **working memory** ``W``: a dense fp
``ContextKV`` of the same geometry with spare slots for the prompt and the answer, so that
generation appends in place and attends over views (the KV memory's fast path; decoding over
quantized chunks directly dequantizes every chunk at every token, docs/kv-memory.md). Loading
fills ``W`` layer by layer:

* chunks resident in ``C`` are dequantized into ``W`` in a few batched tensor operations per level;
* chunks on flash are swapped into ``C`` (at their level, checksum-checked, ``O_DIRECT``) by a
  small pool of reader threads while the compute thread works: one read per run of records
  adjacent in a segment file (or per chunk file), its records (every layer of a token chunk
  each) then checked, joined per level, swapped into ``C`` and written into ``W`` by the reader;
* chunks restored from a remote source (the server's stream) are written into ``W`` by a thread
  of their own, beside the readers;
* chunks chosen for recomputation (and absent ones, which have nothing to read) are recomputed
  from their token ids, **layer-major and batched**: at layer ``l`` the hidden states of every
  recomputed token go through the decoder layer's own modules (the attention module's ``forward``
  with a one-layer cache, so hooks fire), their K/V are written into ``W`` at their global
  positions, and their queries attend over the whole layer in ``W`` with explicit positions (query
  ``i`` sees every key at a position ``<= q_pos[i]``: interleaved missing chunks are exact, LLMS
  figure 7). The recomputed chunks are put into ``C`` at their level.

A full prefill (a new context) is the same recomputation with every chunk missing.

:func:`load` takes a :class:`LoadRequest` (which token chunks come from flash, recomputation or
a remote) and :class:`LoadOptions` (pipelining, readers, the per-layer callback, the levels
recomputed chunks are kept at); :class:`Load` runs it.

Threads (one load):

* the **compute thread** (the caller, :class:`Load`) dequantizes the resident chunks (every
  layer at once), waits for the reads (and the remote chunks) that lie before its last
  recomputed chunk, then recomputes layer by layer, then waits for the remaining reads and the
  remote; it calls ``on_layer`` after each layer and each wait;
* the **readers** (:class:`FileReads`, ``io_threads`` of them) each read one run of records
  (a few MiB of a segment, or one chunk file), check its records, join them per level, swap
  them into ``C`` and write them into ``W``; the planner recomputes
  the *earliest* missing chunks, so the reads of the later ones overlap the whole recomputation;
* the **remote thread** (:class:`RemoteFetch`) writes the streamed chunks into ``W``.

Lock discipline: the token chunks of ``W`` are partitioned among the writers (resident,
read, streamed and recomputed chunks are disjoint sets), so no two threads write the same
slots and ``W`` needs no lock; a recomputed query reads only positions up to its own, all of
which are written before it runs (the waits above). ``C`` is shared under its own lock (the
readers swap in, the compute thread snapshots resident payloads and, after every thread is
joined, puts the recomputed chunks). Each worker keeps its own results (failed chunks, bytes,
seconds; the readers' under a lock of theirs) and the compute thread reads them only after
joining it, so :class:`LoadStats` is written by the compute thread alone. A chunk that fails
to arrive is recomputed at the end, once every thread is joined.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from sparkv.cache import (AttentionView, ChunkPayload, ContextKV, FlashError, KVMemoryError,
                          PayloadError, QuantizedTensor, Source)
from sparkv.cache.levels import LEVELS, SIDE_BITS
from sparkv.cache.pages import PAGE_TOKENS
from sparkv.cache.payload import ChunkRun, contiguous_positions
from sparkv.cache.table import RESIDENT
from sparkv.device import dequant
from sparkv.device.flashio import (RUN_BYTES, ReadRun, RecordHead, check_records,
                                   join_records, plan_runs, record_run, records_into)
from sparkv.device.hosttier import tier_holds
from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.runtime.hfcache import model_call

if TYPE_CHECKING:
    from sparkv.device.remote import RemoteSource
    from sparkv.runtime.model import LoadedModel

_ELEM = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def payload_nbytes(level: str, entries: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes a resident chunk payload of ``entries`` (token, head) rows holds at ``level``
    (positions int32; fp values; or codes + fp16 scale and zero per row), K and V."""
    pos = 4 * entries
    if level == "fp":
        return pos + 2 * entries * head_dim * _ELEM.get(dtype, 4)
    return pos + sum(entries * ((head_dim * b + 7) // 8 + 4) for b in SIDE_BITS[level])


def paged_nbytes(level: str, tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes the memory account counts for ``heads`` KV heads of ``tokens`` tokens each at
    ``level``: whole :data:`PAGE_TOKENS`-token pages (each with its int32 fill), an upper bound
    of what :func:`payload_nbytes` counts row by row (a partial page counts whole)."""
    pages = heads * -(-int(tokens) // PAGE_TOKENS)
    return pages * (payload_nbytes(level, PAGE_TOKENS, head_dim, dtype) + 4)


def working_nbytes(geometry: ChunkGeometry, spare_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a dense fp working memory for ``geometry`` with ``spare_tokens`` spare slots."""
    cap = geometry.num_tokens + max(0, spare_tokens)
    return (geometry.num_layers * 2 * geometry.num_kv_heads * cap * geometry.head_dim
            * _ELEM.get(dtype, 4))


def grow_arena(old: ContextKV, spare_tokens: int,
               on_layer: Callable[[], object] | None = None,
               adopt: Callable[[ContextKV], None] | None = None) -> ContextKV:
    """A dense fp working memory holding ``old``'s tokens with ``spare_tokens`` spare slots, made
    **layer by layer**: each new layer is allocated, copied, and ``old``'s layer freed before the
    next, so the two copies never coexist beyond one layer (how a whole-context arena grows
    without twice its bytes). ``adopt`` is called with the new memory before the first layer is
    allocated (the caller registers it in its account); ``on_layer`` after each layer."""
    from sparkv.cache.layer import LayerStore

    g = old.geometry
    n = g.num_tokens
    W = ContextKV(g, old.dtype, old.device, paged=True)
    if adopt is not None:
        adopt(W)
    cap = n + max(0, spare_tokens)
    for l in range(g.num_layers):  # noqa: E741
        src = old.layers[l]
        if src is None or src.ragged or src.k is None or src.v is None:
            raise KVMemoryError(f"layer {l} of the memory to grow is not a dense arena")
        dst = LayerStore(g.num_kv_heads, g.head_dim, cap, old.dtype, old.device)
        assert dst.k is not None and dst.v is not None
        dst.k[:, :, :n] = src.k[:, :, :n]
        dst.v[:, :, :n] = src.v[:, :, :n]
        dst.end = n
        W.set_arena(l, dst)
        old.set_arena(l, None)
        del src
        if on_layer is not None:
            on_layer()
    return W


def token_chunk_ids(geometry: ChunkGeometry, t: int) -> list[KVChunkId]:
    return [KVChunkId(t, l, g) for l in range(geometry.num_layers)  # noqa: E741
            for g in range(geometry.num_groups)]


# ---- the working memory --------------------------------------------------------------------------
def _codes_u8(t: QuantizedTensor) -> torch.Tensor:
    """The codes of ``t`` as one uint8 per value ``[rows, dim]`` (int4 / int2 unpacked in uint8,
    no int32 temporaries)."""
    if t.bits == 8:
        return t.codes
    per = 8 // t.bits
    shifts = torch.arange(per, dtype=torch.uint8, device=t.codes.device) * t.bits
    return ((t.codes.unsqueeze(-1) >> shifts) & ((1 << t.bits) - 1)).reshape(
        t.codes.shape[0], -1)[:, :t.dim]


def dequantize_fast(t: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequantize(t, dtype)``, bit for bit, with the int4 / int2 codes unpacked in uint8 (no
    int32 temporaries) and the affine map in place: int4 and int2 cost about what int8 does."""
    q = _codes_u8(t)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    out.copy_(q)
    out.mul_(t.scale.float().unsqueeze(1)).add_(t.zero.float().unsqueeze(1))
    return out if dtype == torch.float32 else out.to(dtype)


def fill_layer(C: ContextKV, W: ContextKV, l: int, skip: set[int] | None = None) -> int:  # noqa: E741
    """Writes every resident chunk of layer ``l`` of ``C`` (except token chunks in ``skip``) into
    ``W``'s dense arena (:func:`fill_layers`). Returns the number of chunks written."""
    return fill_layers(C, W, [l], skip)


def _dense_stores(W: ContextKV, layers: Sequence[int]) -> None:
    for l in layers:  # noqa: E741
        store = W.layers[l]
        if store is None or store.ragged or store.k is None or store.v is None:
            raise KVMemoryError(f"the working memory's layer {l} is not a dense arena")


def fill_layers(C: ContextKV, W: ContextKV, layers: Sequence[int], skip: set[int] | None = None,
                only: set[int] | None = None) -> int:
    """Writes every resident chunk of ``layers`` of ``C`` (token chunks in ``only`` if given,
    except those in ``skip``) into ``W``'s dense arena, **straight from the pages**: per level,
    one gather of the pages' rows (:meth:`ContextKV.read_paged`) and one dequantization of all
    of them, then one copy per (layer, group) and side (a slice copy for consecutive chunks,
    else one ``index_copy_``), however finely the levels interleave. No object per chunk.
    Returns the number of chunks written."""
    g = C.geometry
    _dense_stores(W, layers)
    ts = np.array([t for t in (range(g.num_token_chunks) if only is None else sorted(only))
                   if not (skip and t in skip) and t < g.num_token_chunks], dtype=np.int64)
    ls = np.asarray(list(layers), dtype=np.int64)
    if not ts.size or not ls.size:
        return 0
    G = g.num_groups
    # chunk order (l, g, t): each (layer, group)'s chunks of one level are adjacent in a run
    l_, g_, t_ = (a.reshape(-1) for a in np.meshgrid(ls, np.arange(G), ts, indexing="ij"))
    written = 0
    index: dict[tuple[int, ...], torch.Tensor] = {}
    for which, run in C.read_paged(t_, l_, g_):
        tt, ll, gg = t_[which], l_[which], g_[which]
        n = np.minimum(g.chunk_tokens, g.num_tokens - tt * g.chunk_tokens)
        if (run.counts != n[:, None]).any():
            bad = int(np.flatnonzero((run.counts != n[:, None]).any(axis=1))[0])
            raise KVMemoryError(f"chunk {KVChunkId(int(tt[bad]), int(ll[bad]), int(gg[bad]))} "
                                "is pruned; the context service keeps whole chunks")
        _scatter_run(W, run, tt, ll, gg, n, index)
        written += int(which.size)
    for l in layers:  # noqa: E741
        store = W.layers[l]
        assert store is not None
        store.end = max(store.end, g.num_tokens)
    return written


def _values(x: Any, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fast(x, dtype) if isinstance(x, QuantizedTensor) else x.to(dtype)


def _scatter_run(W: ContextKV, run: Any, tt: np.ndarray, ll: np.ndarray, gg: np.ndarray,
                 n: np.ndarray, index: dict[tuple[int, ...], torch.Tensor]) -> None:
    """Writes ``run`` (whole chunks ``tt, ll, gg`` of ``n`` tokens, at one level, ordered so
    that each (layer, group)'s chunks are adjacent) into ``W``'s dense arena: per block of
    chunks of one (layer, group, length) and side, quantized rows are dequantized straight into
    the arena's slots (:func:`~sparkv.device.dequant.dequantize_into`: one pass, no temporary),
    fp rows copied (one slice copy or ``index_copy_``)."""
    g = W.geometry
    hg, d, T = g.heads_per_group, g.head_dim, g.chunk_tokens
    first = W.layers[int(ll[0])]
    fused = (isinstance(run.k, QuantizedTensor) and first is not None and first.k is not None
             and dequant.supported(first.k))
    if fused:
        sides = [(x, x.scale.float().numpy(), x.zero.float().numpy()) for x in (run.k, run.v)]
    else:
        vals = (_values(run.k.to(W.device), W.dtype), _values(run.v.to(W.device), W.dtype))
    starts = np.concatenate([[0], np.cumsum(n * hg)])
    key = (ll * g.num_groups + gg) * (T + 1) + n
    cuts = np.flatnonzero(np.diff(key)) + 1
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(key)]):
        l, grp, m = int(ll[a]), int(gg[a]), int(n[a])  # noqa: E741
        store = W.layers[l]
        assert store is not None and store.k is not None and store.v is not None
        h0, h1 = g.head_range(grp)
        r0, r1 = int(starts[a]), int(starts[b])
        ts = tt[a:b].tolist()
        for i, dst in enumerate((store.k[0, h0:h1], store.v[0, h0:h1])):
            if fused:
                x, sc, ze = sides[i]
                dequant.dequantize_into(dst, x, r0, ts, m, T, sc, ze)
            else:
                src = vals[i][r0:r1].view(b - a, hg, m, d).transpose(0, 1)
                _write_chunks(dst, src, ts, m, T, index)


def _write_chunks(dst: torch.Tensor, src: torch.Tensor, ts: Sequence[int], n: int, T: int,
                  index: dict[tuple[int, ...], torch.Tensor]) -> None:
    """Writes ``src`` ``[hg, c, n, d]`` (chunks ``ts`` of one layer, ``n`` tokens each; a view
    in any order) into the arena slice ``dst`` ``[hg, tokens, d]``: one slice copy when they are
    consecutive (or one chunk), else one ``index_copy_`` (the positions cached in ``index`` by
    ``ts``)."""
    hg, c, _, d = src.shape
    if (n == T or c == 1) and list(ts) == list(range(ts[0], ts[0] + c)):
        t0 = ts[0] * T
        dst[:, t0:t0 + c * n].view(hg, c, n, d).copy_(src)
        return
    key = (n, *ts)
    idx = index.get(key)
    if idx is None:
        idx = (torch.tensor(list(ts), dtype=torch.long)[:, None] * T
               + torch.arange(n, dtype=torch.long)).reshape(-1).to(dst.device)
        index[key] = idx
    dst.index_copy_(1, idx, src.reshape(hg, c * n, d))


def fill_run(W: ContextKV, run: ChunkRun, ts: Sequence[int], n: int,
             arena: dequant.Arena | None = None) -> None:
    """Writes ``run`` (the records of token chunks ``ts``, ``n`` tokens each, one level, record
    after record: :func:`~sparkv.device.flashio.join_records`) into ``W``'s dense arena:
    quantized into float32, one numba call per side for all of them and every layer
    (:meth:`~sparkv.device.dequant.Arena.records_into`; ``arena``: ``W``'s, made once per load
    by the caller, else here); else one dequantization, then one copy per (layer, group) and
    side (a slice copy for consecutive token chunks, else one ``index_copy_``)."""
    g = W.geometry
    L, G, hg, d, T = (g.num_layers, g.num_groups, g.heads_per_group, g.head_dim,
                      g.chunk_tokens)
    _dense_stores(W, range(L))
    ts = list(ts)
    if not ts:
        return
    if fused(W, run):
        assert isinstance(run.k, QuantizedTensor) and isinstance(run.v, QuantizedTensor)
        (arena or dequant.Arena(W.layers)).records_into(run.k, run.v, ts, n, T, G)
        return
    m = len(ts)
    index: dict[tuple[int, ...], torch.Tensor] = {}
    run = run.to(W.device)          # records read from flash, for a memory on a GPU: one copy
    ks = _values(run.k, W.dtype).view(m, L, G, hg, n, d)
    vs = _values(run.v, W.dtype).view(m, L, G, hg, n, d)
    for l in range(L):  # noqa: E741
        store = W.layers[l]
        assert store is not None and store.k is not None and store.v is not None
        for grp in range(G):
            h0, h1 = g.head_range(grp)
            _write_chunks(store.k[0, h0:h1], ks[:, l, grp].transpose(0, 1), ts, n, T, index)
            _write_chunks(store.v[0, h0:h1], vs[:, l, grp].transpose(0, 1), ts, n, T, index)


def fused(W: ContextKV, run: ChunkRun) -> bool:
    """Whether ``run``'s rows are dequantized straight into ``W`` (quantized rows, a float32
    arena on the CPU)."""
    first = W.layers[0]
    return (isinstance(run.k, QuantizedTensor) and first is not None and first.k is not None
            and dequant.supported(first.k))


def chunk_payload(W: ContextKV, cid: KVChunkId, level: str) -> ChunkPayload:
    """The chunk's entries from the working memory's dense arena, at ``level``."""
    g = W.geometry
    store = W.layers[cid.l]
    assert store is not None and store.k is not None and store.v is not None
    t0, t1 = g.token_range(cid.t)
    h0, h1 = g.head_range(cid.g)
    n = t1 - t0
    k = store.k[0, h0:h1, t0:t1].reshape(-1, g.head_dim).clone()
    v = store.v[0, h0:h1, t0:t1].reshape(-1, g.head_dim).clone()
    p = ChunkPayload(cid, "fp", [n] * (h1 - h0), contiguous_positions([n] * (h1 - h0), t0), k, v,
                     W.dtype)
    return p if level == "fp" else p.at_level(level)


def token_chunk_run(W: ContextKV, t: int, level: str) -> ChunkRun:
    """Token chunk ``t``'s chunks (every ``(l, g)``, layer-major) from the working memory's
    dense arena, at ``level``: one run, converted at once (the same bits as
    :func:`chunk_payload` chunk by chunk)."""
    g = W.geometry
    t0, t1 = g.token_range(t)
    n, hg = t1 - t0, g.heads_per_group
    ks, vs = [], []
    for l in range(g.num_layers):  # noqa: E741
        store = W.layers[l]
        assert store is not None and store.k is not None and store.v is not None
        ks.append(store.k[0, :, t0:t1])
        vs.append(store.v[0, :, t0:t1])
    m = g.num_layers * g.num_groups
    run = ChunkRun(token_chunk_ids(g, t), "fp", np.full((m, hg), n, dtype=np.int64),
                   torch.arange(t0, t1, dtype=torch.int32).repeat(m * hg),
                   torch.stack(ks).reshape(-1, g.head_dim).clone(),
                   torch.stack(vs).reshape(-1, g.head_dim).clone(), W.dtype)
    return run if level == "fp" else run.at_level(level)


def put_token_chunk(C: ContextKV, W: ContextKV, t: int, level: str, source: Source) -> None:
    """Puts token chunk ``t`` of ``W`` into ``C`` at ``level`` (only the chunks ``C`` does not
    hold): one conversion and one page write."""
    run = token_chunk_run(W, t, level)
    away = set(C.missing(run.cids))
    if len(away) == len(run.cids):
        C.hold([run], source)
    elif away:
        C.hold([ChunkRun.cat([run.piece(j, j + 1) for j, c in enumerate(run.cids)
                              if c in away])], source)


# ---- recomputation -------------------------------------------------------------------------------
class _LayerCache:
    """The cache one batched recomputation step hands the attention module: ``update`` writes
    the recomputed K/V into the working memory at their positions and returns what the queries
    may see (the density hook reads ``density_keys`` / ``density_q_pos``)."""

    def __init__(self, W: ContextKV, l: int, pos: torch.Tensor, contiguous: bool) -> None:  # noqa: E741
        self.W, self.l, self.pos, self.contiguous = W, l, pos, contiguous
        self.density_keys: torch.Tensor | None = None
        self.density_q_pos = pos

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[AttentionView, AttentionView]:
        store = self.W.layers[self.l]
        assert store is not None and store.k is not None and store.v is not None
        store.k[0].index_copy_(1, self.pos, key_states[0].to(store.k.dtype))
        store.v[0].index_copy_(1, self.pos, value_states[0].to(store.v.dtype))
        s = int(self.pos[-1]) + 1
        k, v = store.k[:, :, :s], store.v[:, :, :s]
        self.density_keys = k
        if self.contiguous:
            view = AttentionView(self.pos, k=k, v=v)
        else:
            kpos = torch.arange(s, device=k.device)
            view = AttentionView(self.pos, heads=[(k[0, h], v[0, h], kpos)
                                                  for h in range(k.shape[1])])
        return view, view


class Recompute:
    """Layer-major batched recomputation of some token chunks of a context into ``W``.

    Args:
        lm: the loaded model.
        tokens: the context's token ids (every position of ``W``'s geometry).
        W: the working memory (dense fp arena).
        chunks: token chunks to recompute.
    """

    def __init__(self, lm: LoadedModel, tokens: Sequence[int], W: ContextKV,
                 chunks: Sequence[int]) -> None:
        g = W.geometry
        self.lm, self.W, self.g = lm, W, g
        self.chunks = sorted(set(int(t) for t in chunks))
        pos = [p for t in self.chunks for p in range(*g.token_range(t))]
        self.pos = torch.tensor(pos, dtype=torch.long, device=lm.device)
        self.contiguous = bool(pos) and pos == list(range(pos[0], pos[0] + len(pos)))
        ids = torch.tensor([tokens[p] for p in pos], dtype=torch.long, device=lm.device)
        self.x: torch.Tensor | None = None
        self._ids = ids
        self.seconds = 0.0

    @property
    def empty(self) -> bool:
        return not self.chunks

    @torch.inference_mode()
    def layer(self, l: int) -> None:  # noqa: E741
        """Runs layer ``l`` for every recomputed token (writes their K/V into ``W``)."""
        if self.empty:
            return
        t0 = time.perf_counter()
        lm = self.lm
        dec = lm.decoder
        if l == 0:
            self.x = dec.embed_tokens(self._ids.unsqueeze(0))
            cos, sin = dec.rotary_emb(self.x, self.pos.unsqueeze(0))
            self._pe = (cos.to(self.x.dtype), sin.to(self.x.dtype))
        assert self.x is not None
        layer = dec.layers[l]
        h = layer.input_layernorm(self.x)
        cache = _LayerCache(self.W, l, self.pos, self.contiguous)
        attn, _ = model_call(layer.self_attn, hidden_states=h, position_embeddings=self._pe,
                             attention_mask=None, cache=cache)
        if l < self.g.num_layers - 1:
            x = self.x + attn
            self.x = x + layer.mlp(layer.post_attention_layernorm(x))
        else:
            self.x = None
        self.seconds += time.perf_counter() - t0


# ---- the pipeline --------------------------------------------------------------------------------
@dataclass
class LoadStats:
    """What one load did (seconds are wall clock of each part)."""

    read_chunks: int = 0          # token chunks read back (from flash, or the host tier's copy)
    host_chunks: int = 0          # of them, the host tier's copies (no flash read)
    host_bytes: int = 0           # their bytes
    streamed_chunks: int = 0      # token chunks restored from a remote source (the server)
    bytes_streamed: int = 0       # their decoded bytes
    stream_s: float = 0.0         # the remote fetch thread busy
    recomputed_chunks: int = 0    # token chunks recomputed
    resident_chunks: int = 0      # token chunks already in RAM
    files_read: int = 0           # distinct files read from
    reads: int = 0                # read requests (a chunk file, or a run of segment records)
    bytes_read: int = 0
    faults: int = 0               # token chunks whose file failed (then recomputed)
    io_s: float = 0.0             # the I/O thread busy
    read_s: float = 0.0           # in the flash reads themselves (summed over the readers)
    recompute_s: float = 0.0
    fill_s: float = 0.0           # dequantizing into the working memory
    wait_io_s: float = 0.0        # compute thread waiting for the I/O thread
    total_s: float = 0.0
    predicted_s: float = 0.0
    pipelined: bool = True
    notes: list[str] = field(default_factory=list)
    #: the token chunks by where their KV came from: a level's name (read or resident at that
    #: level), ``recomputed``, ``streamed``, or ``working memory`` (the one the context's last
    #: call or its import left, kept)
    sources: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class LoadRequest:
    """What one load fills the working memory from: the token chunks of each source.

    Attributes:
        read: token chunks to swap in from the flash tier: their records (every layer,
            :func:`~sparkv.device.flashio.unpack_token_chunk`), read in runs of adjacent
            records. Those wholly resident in ``C`` are filled from it; those with no flash copy
            are recomputed.
        recompute: token chunks to recompute from the context's token ids.
        stream, remote, remote_chunks: token chunks restored from ``remote`` (a
            :class:`~sparkv.device.remote.RemoteSource`) by fetching ``remote_chunks`` (its
            chunks and levels); ``stream`` is ignored without a ``remote``. A chunk the remote
            fails to deliver is recomputed.
    """

    read: Sequence[int] = ()
    recompute: Sequence[int] = ()
    stream: Sequence[int] = ()
    remote: RemoteSource | None = None
    remote_chunks: Sequence[tuple[KVChunkId, str]] = ()


@dataclass(frozen=True)
class LoadOptions:
    """How one load runs.

    Attributes:
        pipeline: overlap the reads with the work of the compute thread (the dequantization of
            the resident chunks and the recomputation: the planner recomputes the *earliest*
            missing chunks, whose queries attend over nothing that is being read); without it
            every read finishes before anything is filled (the "without pipeline" ablation and
            the chunk-swapping baselines).
        io_threads: reader threads (runs of records read at a time).
        on_layer: called by the compute thread after each layer and each wait (the service
            checks its budget there; what it raises ends the load).
        level_of: the level a recomputed (or streamed) token chunk is put into ``C`` at
            (default int8).
        store_recomputed: put the recomputed and streamed chunks into ``C`` (a new context's
            first prefill does not: its working memory becomes its memory).
    """

    pipeline: bool = True
    io_threads: int = 4
    on_layer: Callable[[], object] | None = None
    level_of: Callable[[int], str] | None = None
    store_recomputed: bool = True


def flash_refs(C: ContextKV, read: Sequence[int],
               recompute: Sequence[int]) -> tuple[dict[int, Any], set[int]]:
    """Of the token chunks to ``read`` (less those to ``recompute``): the flash copy of each one
    not wholly resident, and those with nothing to read (absent: recomputed instead)."""
    rows = C.by_token()
    refs: dict[int, Any] = {}
    absent: set[int] = set()
    ts = np.array(sorted(set(read) - set(recompute)), dtype=np.int64)
    away = rows.residency[ts] != RESIDENT                 # [n, L * G]
    some = away.any(axis=1)
    for t, j in zip(ts[some].tolist(), away.argmax(axis=1)[some].tolist()):
        ref = rows.ref(t, j)
        if ref is None:
            absent.add(t)
        else:
            refs[t] = ref
    return refs, absent


def pages_to_read(C: ContextKV, refs: dict[int, Any]) -> dict[str, int]:
    """Pages the records of token chunks ``refs`` take once swapped in (their chunks not
    resident, at their stored levels), per level."""
    g = C.geometry
    rows = C.by_token()
    ts = np.fromiter(refs, dtype=np.int64, count=len(refs))
    level = rows.level[ts]                                 # [n, L * G]
    away = (rows.residency[ts] != RESIDENT) & (level >= 0)
    per = g.heads_per_group * -(-np.array([g.chunk_len(t) for t in ts.tolist()],
                                          dtype=np.int64) // PAGE_TOKENS)
    return {LEVELS[int(code)]: int((((level == code) & away).sum(axis=1) * per).sum())
            for code in np.unique(level[away])}


def _from_host(tier: Any, run: ReadRun) -> bytes | bytearray | None:
    """The run's bytes assembled from the host tier's copies of its records (each at its offset
    in the run, as a read of it would give them; one record: the copy itself), else ``None``
    when one is not held (then the run is read from flash)."""
    if getattr(tier, "host", None) is None:
        return None
    copies = tier.from_host([ref for _, ref in run.records])
    if copies is None:
        return None
    if len(copies) == 1:
        return copies[0]
    buf = bytearray(run.nbytes)
    for (_, ref), data in zip(run.records, copies):
        at = ref.offset - run.offset
        buf[at:at + len(data)] = data
    return buf


class FileReads:
    """The reader pool of one load: reads the token chunk records ``refs`` (``threads`` reads at
    a time), swaps them into ``C`` and, when ``W`` is another memory, writes them into ``W``
    (on the reader's thread).

    The records are read in **runs** (:func:`~sparkv.device.flashio.plan_runs`): records adjacent
    in one file (a segment's) are read with one request of at most ``run_bytes`` (a chunk file is
    a run of its own), then each record is checked (its checksum, header, length, token chunk
    and geometry: :func:`~sparkv.device.flashio.check_records`) and the good ones are, per
    level, copied straight from the read buffer into new pages with one page write
    (:func:`~sparkv.device.flashio.records_into`) and filled from those pages with one call per
    side (:func:`fill_run`). A run that cannot be read, or a record
    that fails its check or lies
    past what was read, fails only its own chunks: they are recomputed.

    State and locks: :meth:`start`, :meth:`wait` and :meth:`close` belong to the compute
    thread; the pool's threads run the reads, one run each. A reader writes only its own token
    chunks' slots of ``W`` (nothing else in the load writes them) and swaps into ``C`` under
    ``C``'s own lock. ``failed``, ``reads``, ``files``, ``nbytes`` and the busy window are
    written by the readers under ``_lock``; the compute thread reads them after :meth:`close`
    (the pool's shutdown joins every reader). A record that fails (flash, payload or memory
    error) is counted in ``failed``; any other error is raised by :meth:`wait`.
    """

    def __init__(self, C: ContextKV, W: ContextKV, tier: Any, refs: dict[int, Any],
                 threads: int, run_bytes: int = RUN_BYTES) -> None:
        self.C, self.W, self.tier, self.refs = C, W, tier, refs
        self.chunks = sorted(refs)
        held = {t: ref for t, ref in refs.items() if tier_holds(tier, ref)}
        rest = {t: ref for t, ref in refs.items() if t not in held}
        self.runs = plan_runs(held, tier.io.align, run_bytes) if held else []  # RAM first
        self.runs += plan_runs(rest, tier.io.align, run_bytes) if rest else []
        self._run_of = {t: i for i, run in enumerate(self.runs) for t, _ in run.records}
        self.failed: set[int] = set()
        self.reads = 0
        self.files: set[str] = set()
        self.nbytes = 0
        self.host_chunks = 0                # records the host tier answered
        self.host_bytes = 0
        self.read_s = 0.0
        self._window = [math.inf, 0.0]     # first read's start, last read's end
        self._lock = threading.Lock()
        self._pool = (ThreadPoolExecutor(max(1, min(threads, len(self.runs))))
                      if self.runs else None)
        self._futures: list[Future[None]] = []
        self._targets: dequant.Arena | None = None

    def start(self) -> None:
        if self._pool is not None:
            self._futures = [self._pool.submit(self._read_run, run) for run in self.runs]

    def wait(self, ts: Sequence[int]) -> float:
        """Waits for the reads of ``ts``; returns the seconds waited."""
        w0 = time.perf_counter()
        for i in sorted({self._run_of[t] for t in ts}):
            self._futures[i].result()
        return time.perf_counter() - w0

    def close(self) -> None:
        """Waits for every read (also after an error of the compute thread)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    @property
    def busy_s(self) -> float:
        """Seconds from the first read's start to the last one's end (0 without reads)."""
        return max(0.0, self._window[1] - self._window[0]) if self.chunks else 0.0

    def _read_run(self, run: ReadRun) -> None:
        t0 = time.perf_counter()
        try:
            held = _from_host(self.tier, run)
            if held is not None:
                with self._lock:
                    self.host_chunks += len(run.records)
                    self.host_bytes += sum(ref.nbytes for _, ref in run.records)
                self._use(run, held, flash=False)
                return
            with contextlib.ExitStack() as stack:
                try:
                    data: bytes | memoryview = stack.enter_context(
                        self.tier.read_view(run.path, run.offset, run.nbytes))
                except FlashError:
                    data = b""
                else:
                    with self._lock:
                        self.read_s += time.perf_counter() - t0
                        self.reads += 1
                        self.files.add(run.path)
                        self.nbytes += len(data)
                self._use(run, data)
        finally:
            with self._lock:
                self._window[0] = min(self._window[0], t0)
                self._window[1] = max(self._window[1], time.perf_counter())

    def _use(self, run: ReadRun, data: bytes | bytearray | memoryview, flash: bool = True
             ) -> None:
        """Checks the records of ``run`` read into ``data`` and fills the good ones (nothing of
        ``data`` is kept: it is the read's buffer, reused after, but the good records of a
        flash read are copied into the host tier when there is one)."""
        heads, bad = check_records(data, [(t, ref.offset - run.offset, ref.nbytes)
                                          for t, ref in run.records])
        ok = [h for h in heads if self._fits(h)]
        bad += [h.t for h in heads if not self._fits(h)]
        if bad:
            with self._lock:
                self.failed.update(bad)
        if flash and getattr(self.tier, "host", None) is not None:
            good = {h.t for h in ok}
            for t, ref in run.records:
                if t in good:
                    a = ref.offset - run.offset
                    self.tier.to_host(ref, data[a:a + ref.nbytes])
        self._fill(data, ok)

    def _fits(self, h: RecordHead) -> bool:
        """Whether record ``h`` is its token chunk's in ``C``'s geometry and dtype."""
        g = self.C.geometry
        return (h.layers, h.groups, h.heads, h.head_dim, h.tokens, h.start) == (
            g.num_layers, g.num_groups, g.heads_per_group, g.head_dim, g.chunk_len(h.t),
            g.token_range(h.t)[0]) and h.dtype == self.C.dtype

    def _fill(self, data: bytes | bytearray | memoryview, heads: list[RecordHead]) -> None:
        """Swaps the checked records ``heads`` of ``data`` into ``C`` and writes them into
        ``W``: per level, one run of them written straight from ``data`` into the new pages
        (:meth:`_swap_in_records`: one copy, the chunk table updated once) and one fill of ``W``
        per length from those pages (:func:`fill_run`, views of the run); a run whose swap-in
        fails (a memory error: no
        flash copy recorded, the pool full) is retried record by record, and a record failing
        again is counted failed."""
        levels: dict[str, list[RecordHead]] = {}
        for h in sorted(heads, key=lambda h: -h.tokens):       # equal lengths adjacent
            levels.setdefault(h.level, []).append(h)
        for hs in levels.values():
            try:
                run = self._swap_in_records(data, hs)
            except (KVMemoryError, PayloadError):
                hs = [h for h in hs if self._swap_in_one(data, h)]
                if not hs:
                    continue
                run = join_records(data, hs)
            if self.C is not self.W:
                self._fill_working(run, hs)

    def _fill_working(self, run: ChunkRun, fs: list[RecordHead]) -> None:
        """Writes ``run`` (the records ``fs``, equal lengths adjacent) into ``W``: one
        :func:`fill_run` per length."""
        m = len(run.cids) // len(fs)
        a = 0
        while a < len(fs):
            b = a
            while b < len(fs) and fs[b].tokens == fs[a].tokens:
                b += 1
            piece = run if (a, b) == (0, len(fs)) else run.piece(a * m, b * m)
            try:
                fill_run(self.W, piece, [f.t for f in fs[a:b]], fs[a].tokens,
                         self._arena() if fused(self.W, piece) else None)
            except KVMemoryError:
                with self._lock:
                    self.failed.update(f.t for f in fs[a:b])
            a = b

    def _arena(self) -> dequant.Arena:
        """``W``'s layers as the dequantization's targets, made once per load."""
        with self._lock:
            if self._targets is None:
                _dense_stores(self.W, range(self.W.geometry.num_layers))
                self._targets = dequant.Arena(self.W.layers)
            return self._targets

    def _swap_in_one(self, data: bytes | bytearray | memoryview, h: RecordHead) -> bool:
        """Record ``h`` swapped in alone; ``False`` (counted failed) when that fails too."""
        try:
            self._swap_in(join_records(data, [h]))
            return True
        except (KVMemoryError, PayloadError):
            with self._lock:
                self.failed.add(h.t)
            return False

    def _swap_in_records(self, data: bytes | bytearray | memoryview, hs: list[RecordHead]
                         ) -> ChunkRun:
        """The records ``hs`` (one level) swapped into ``C``: when none of their chunks is
        resident, written straight from ``data`` into the new pages
        (:meth:`~sparkv.cache.memory.ContextKV.swap_in_placed`: one copy); else joined first
        (:meth:`_swap_in`). Returns their run (for ``W``)."""
        shape = record_run(hs)
        if self.C.resident(shape.cids).any():
            run = join_records(data, hs)
            self._swap_in(run)
            return run
        return self.C.swap_in_placed(shape.cids, shape.level, shape.counts, shape.pos,
                                     lambda k, v: records_into(data, hs, k, v))

    def _swap_in(self, run: ChunkRun) -> None:
        """The run's chunks not resident in ``C`` held there, resident and clean: one page
        write."""
        away = self.C.missing(run.cids)
        if len(away) == len(run.cids):
            self.C.swap_in_runs([run])
        elif away:
            miss = set(away)
            self.C.swap_in_runs([ChunkRun.cat([run.piece(j, j + 1)
                                               for j, c in enumerate(run.cids) if c in miss])])


class RemoteFetch:
    """The remote thread of one load: fetches ``chunks`` (ids and levels) from ``remote`` and
    writes the entries of the token chunks ``want`` into ``W`` at their positions.

    State and locks: :meth:`start` and :meth:`wait` belong to the compute thread; the fetch runs
    on a daemon thread of its own, which writes only the ``want`` token chunks' slots of ``W``.
    ``failed`` (token chunks not wholly delivered), ``nbytes``, ``busy_s`` and ``notes`` are
    written by that thread alone and read by the compute thread after :meth:`wait` (the
    ``_done`` event orders them). No lock is needed.
    """

    def __init__(self, W: ContextKV, remote: RemoteSource | None, want: Sequence[int],
                 chunks: Sequence[tuple[KVChunkId, str]]) -> None:
        self.W, self.remote, self.chunks = W, remote, chunks
        self.want = sorted(want) if remote is not None else []
        self.failed: set[int] = set()
        self.nbytes = 0
        self.busy_s = 0.0
        self.notes: list[str] = []
        self._done = threading.Event()
        if not self.want:
            self._done.set()

    def start(self) -> None:
        if self.want:
            threading.Thread(target=self._run, daemon=True, name="sparkv-device-net").start()

    def wait(self) -> float:
        """Waits for the fetch to end; returns the seconds waited."""
        w0 = time.perf_counter()
        self._done.wait()
        return time.perf_counter() - w0

    def _run(self) -> None:
        t0 = time.perf_counter()
        remote = self.remote
        assert remote is not None      # nothing is wanted without one (start runs nothing)
        got: dict[int, int] = {}       # token chunk -> (layer, group) pieces written
        need = self.W.geometry.num_layers * int(remote.geometry.num_groups)
        try:
            for cid, start, k, v in remote.fetch(self.chunks):
                self._write(remote.geometry, cid, start, k, v, got)
        except Exception as e:  # noqa: BLE001 - a remote that fails: recompute what is missing
            self.notes.append(f"remote: {e}")
        finally:
            self.failed = {t for t in self.want if got.get(t, 0) < need}
            self.busy_s = time.perf_counter() - t0
            self._done.set()

    def _write(self, rg: ChunkGeometry, cid: KVChunkId, start: int, k: torch.Tensor,
               v: torch.Tensor, got: dict[int, int]) -> None:
        """Writes the wanted token chunks of one fetched piece (``k``, ``v``: heads x tokens
        x head_dim from position ``start``; ``rg``: the remote's chunking) into ``W``."""
        g = self.W.geometry
        T = g.chunk_tokens
        n = int(k.shape[1])
        h0, h1 = rg.head_range(cid.g)
        store = self.W.layers[cid.l]
        assert store is not None and store.k is not None and store.v is not None
        for t in range(start // T, -(-(start + n) // T)):
            if t not in self.want:
                continue
            a, b = g.token_range(t)
            store.k[0, h0:h1, a:b] = k[:, a - start:b - start].to(store.k.dtype)
            store.v[0, h0:h1, a:b] = v[:, a - start:b - start].to(store.v.dtype)
            got[t] = got.get(t, 0) + 1
            self.nbytes += int(k[:, a - start:b - start].numel() * k.element_size() * 2)


class Load:
    """One load, run by the calling (compute) thread: :meth:`run` (module docstring,
    "Threads").

    State: ``stats``, written by the compute thread only (the readers' and the remote thread's
    counts are copied in after they are joined).
    """

    def __init__(self, lm: LoadedModel, tokens: Sequence[int], C: ContextKV, W: ContextKV,
                 tier: Any, options: LoadOptions) -> None:
        self.lm, self.tokens, self.C, self.W, self.tier = lm, tokens, C, W, tier
        self.options = options
        self.stats = LoadStats(pipelined=options.pipeline)

    def run(self, request: LoadRequest) -> LoadStats:
        start = time.perf_counter()
        refs, absent = flash_refs(self.C, request.read, request.recompute)
        reads = FileReads(self.C, self.W, self.tier, refs, self.options.io_threads)
        stream = (set(request.stream) - set(request.recompute) - set(refs) - absent
                  if request.remote is not None else set())
        fetch = RemoteFetch(self.W, request.remote, sorted(stream), request.remote_chunks)
        fetch.start()
        rec = Recompute(self.lm, self.tokens, self.W, sorted(set(request.recompute) | absent))
        if self.C is not self.W and refs:
            self.C.reserve_pages(pages_to_read(self.C, refs))
        try:
            self._overlap(rec, reads, fetch)
        finally:
            reads.close()
            if self.C is not self.W and refs:
                self.C.reserve_pages(None)
        if self.C is not self.W:
            for store in self.W.layers:
                if store is not None:
                    store.end = max(store.end, self.W.geometry.num_tokens)
        s = self.stats
        s.files_read, s.reads = len(reads.files), reads.reads
        s.bytes_read, s.io_s, s.read_s = reads.nbytes, reads.busy_s, reads.read_s
        s.host_chunks, s.host_bytes = reads.host_chunks, reads.host_bytes
        s.bytes_streamed, s.stream_s = fetch.nbytes, fetch.busy_s
        s.notes.extend(fetch.notes)
        failed = reads.failed | fetch.failed
        recomputed = self._repair(rec, failed)
        streamed = stream - failed
        self._keep(sorted(set(recomputed) | streamed))
        s.read_chunks = len(set(reads.chunks) - failed)
        s.streamed_chunks = len(streamed)
        s.recomputed_chunks = len(recomputed)
        s.total_s = time.perf_counter() - start
        return s

    def _layer_done(self) -> None:
        if self.options.on_layer is not None:
            self.options.on_layer()

    def _overlap(self, rec: Recompute, reads: FileReads, fetch: RemoteFetch) -> None:
        """The compute thread's work while the reads and the fetch run: the resident chunks
        (every layer at once), then the recomputation layer by layer, waiting first for what
        its queries attend over (reads and streamed chunks before its last chunk)."""
        s = self.stats
        reads.start()
        if reads.chunks and not self.options.pipeline:
            s.wait_io_s += reads.wait(reads.chunks)
        f0 = time.perf_counter()
        if self.C is not self.W:
            fill_layers(self.C, self.W, range(self.W.geometry.num_layers),
                        set(rec.chunks) | set(reads.chunks) | set(fetch.want))
        s.fill_s += time.perf_counter() - f0
        last = max(rec.chunks) if rec.chunks else -1
        early = [t for t in reads.chunks if t < last]
        late = [t for t in reads.chunks if t >= last]
        if early:
            s.wait_io_s += reads.wait(early)
            self._layer_done()
        if fetch.want and rec.chunks and min(fetch.want) < last:
            s.wait_io_s += fetch.wait()
        for l in range(self.W.geometry.num_layers):  # noqa: E741
            rec.layer(l)
            self._layer_done()
        if late:
            s.wait_io_s += reads.wait(late)
            self._layer_done()
        s.wait_io_s += fetch.wait()

    def _repair(self, rec: Recompute, failed: set[int]) -> list[int]:
        """The fault path: a token chunk whose record is missing or fails its checksum (or that the
        remote did not deliver) is recomputed, with every recomputed chunk after the first failed
        one (they attended over its unread positions); every other chunk of every layer is in
        ``W`` now, so one more pass is exact. Returns every recomputed token chunk, sorted."""
        s = self.stats
        s.recompute_s = rec.seconds
        if not failed:
            return list(rec.chunks)
        s.faults = len(failed)
        s.notes.append(f"{len(failed)} token chunks failed to read and were recomputed")
        first = min(failed)
        fix = Recompute(self.lm, self.tokens, self.W,
                        sorted(failed | {t for t in rec.chunks if t > first}))
        for l in range(self.W.geometry.num_layers):  # noqa: E741
            fix.layer(l)
        s.recompute_s += fix.seconds
        return sorted(set(rec.chunks) | failed)

    def _keep(self, chunks: Sequence[int]) -> None:
        """Puts the recomputed and streamed token chunks into ``C`` at their level (only where
        ``C`` does not hold them), unless ``store_recomputed`` is off."""
        if not self.options.store_recomputed:
            return
        level_of = self.options.level_of
        for t in chunks:
            put_token_chunk(self.C, self.W, t, level_of(t) if level_of is not None else "int8",
                            Source.COMPUTED)
            self._layer_done()


def load(lm: LoadedModel, tokens: Sequence[int], C: ContextKV, W: ContextKV, tier: Any,
         request: LoadRequest, options: LoadOptions | None = None) -> LoadStats:
    """Fills ``W`` with every layer of the context ``C`` (module docstring).

    Args:
        lm: the loaded model (for the recomputation).
        tokens: the context's token ids.
        C: the context's memory; ``W`` itself for a full prefill (nothing resident, nothing
            read: every chunk recomputed).
        W: the working memory (a dense fp arena of ``C``'s geometry).
        tier: the context's flash tier (a :class:`~sparkv.cache.FlashTier`: ``read_view``,
            ``io.align``).
        request: which token chunks come from where (:class:`LoadRequest`).
        options: how the load runs (:class:`LoadOptions`; default: pipelined, 4 readers).
    """
    return Load(lm, tokens, C, W, tier, options or LoadOptions()).run(request)
