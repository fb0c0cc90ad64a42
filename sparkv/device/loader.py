"""Loading a context for a call: the working memory, chunk recomputation at global positions, and
the IO-recompute pipeline (LLMS section 3.3).

A context's long-lived memory ``C`` is a segmented :class:`~sparkv.cache.ContextKV` (each chunk at
its own level, on flash, or absent). A call runs over a **working memory** ``W``: a dense fp
``ContextKV`` of the same geometry with spare slots for the prompt and the answer, so that
generation appends in place and attends over views (the KV memory's fast path; decoding over
quantized chunks directly dequantizes every chunk at every token, docs/kv-memory.md). Loading
fills ``W`` layer by layer:

* chunks resident in ``C`` are dequantized into ``W`` in a few batched tensor operations per level;
* chunks on flash are swapped into ``C`` (at their level, checksum-checked, ``O_DIRECT``) by an
  I/O thread with a small pool of readers, one layer ahead of the compute thread: the I/O of layer
  ``l+1`` overlaps the work of layer ``l``;
* chunks chosen for recomputation (and absent ones, which have nothing to read) are recomputed
  from their token ids, **layer-major and batched**: at layer ``l`` the hidden states of every
  recomputed token go through the decoder layer's own modules (the attention module's ``forward``
  with a one-layer cache, so hooks fire), their K/V are written into ``W`` at their global
  positions, and their queries attend over the whole layer in ``W`` with explicit positions (query
  ``i`` sees every key at a position ``<= q_pos[i]``: interleaved missing chunks are exact, LLMS
  figure 7). The recomputed chunks are put into ``C`` at their level.

A full prefill (a new context) is the same recomputation with every chunk missing.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from sparkv.cache import (AttentionView, ChunkPayload, ContextKV, FlashError, KVMemoryError,
                          PayloadError, QuantizedTensor, Residency, Source)
from sparkv.cache.payload import contiguous_positions
from sparkv.layout import ChunkGeometry, KVChunkId

_ELEM = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def payload_nbytes(level: str, entries: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes a resident chunk payload of ``entries`` (token, head) rows holds at ``level``
    (positions int32; fp values; or codes + fp16 scale and zero per row), K and V."""
    pos = 4 * entries
    if level == "fp":
        return pos + 2 * entries * head_dim * _ELEM.get(dtype, 4)
    bits = {"int8": 8, "int4": 4, "int2": 2}[level]
    width = (head_dim * bits + 7) // 8
    return pos + 2 * entries * (width + 4)


def working_nbytes(geometry: ChunkGeometry, spare_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a dense fp working memory for ``geometry`` with ``spare_tokens`` spare slots."""
    cap = geometry.num_tokens + max(0, spare_tokens)
    return (geometry.num_layers * 2 * geometry.num_kv_heads * cap * geometry.head_dim
            * _ELEM.get(dtype, 4))


def grow_arena(old: ContextKV, spare_tokens: int,
               on_layer: Callable[[], None] | None = None,
               adopt: Callable[[ContextKV], None] | None = None) -> ContextKV:
    """A dense fp working memory holding ``old``'s tokens with ``spare_tokens`` spare slots, made
    **layer by layer**: each new layer is allocated, copied, and ``old``'s layer freed before the
    next, so the two copies never coexist beyond one layer (how a whole-context arena grows
    without twice its bytes). ``adopt`` is called with the new memory before the first layer is
    allocated (the caller registers it in its account); ``on_layer`` after each layer."""
    from sparkv.cache.layer import LayerStore
    from sparkv.cache.memory import ARENA

    g = old.geometry
    n = g.num_tokens
    W = ContextKV(g, old.dtype, old.device, segmented=True)
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
        with W._lock:
            W.layers[l] = dst
            W.mode[l] = ARENA
            W._arena_bytes += dst.nbytes
        with old._lock:
            old._arena_bytes -= src.nbytes
            old.layers[l] = None
        del src
        if on_layer is not None:
            on_layer()
    return W


def token_chunk_ids(geometry: ChunkGeometry, t: int) -> list[KVChunkId]:
    return [KVChunkId(t, l, g) for l in range(geometry.num_layers)  # noqa: E741
            for g in range(geometry.num_groups)]


# ---- the working memory --------------------------------------------------------------------------
def _stack_values(parts: list[Any]) -> Any:
    if isinstance(parts[0], QuantizedTensor):
        q0 = parts[0]
        return QuantizedTensor(torch.cat([p.codes for p in parts]),
                               torch.cat([p.scale for p in parts]),
                               torch.cat([p.zero for p in parts]), q0.bits, q0.dim)
    return torch.cat(parts)


def dequantize_fast(t: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequantize(t, dtype)``, bit for bit, with the int4 / int2 codes unpacked in uint8 (no
    int32 temporaries) and the affine map in place: int4 and int2 cost about what int8 does."""
    if t.bits == 8:
        q = t.codes
    else:
        per = 8 // t.bits
        shifts = torch.arange(per, dtype=torch.uint8, device=t.codes.device) * t.bits
        q = ((t.codes.unsqueeze(-1) >> shifts) & ((1 << t.bits) - 1)).reshape(
            t.codes.shape[0], -1)[:, :t.dim]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    out.copy_(q)
    out.mul_(t.scale.float().unsqueeze(1)).add_(t.zero.float().unsqueeze(1))
    return out if dtype == torch.float32 else out.to(dtype)


def fill_layer(C: ContextKV, W: ContextKV, l: int, skip: set[int] | None = None) -> int:  # noqa: E741
    """Writes every resident chunk of layer ``l`` of ``C`` (except token chunks in ``skip``) into
    ``W``'s dense arena (:func:`fill_layers`). Returns the number of chunks written."""
    return fill_layers(C, W, [l], skip)


def fill_layers(C: ContextKV, W: ContextKV, layers: Sequence[int], skip: set[int] | None = None,
                only: set[int] | None = None) -> int:
    """Writes every resident chunk of ``layers`` of ``C`` (token chunks in ``only`` if given,
    except those in ``skip``) into ``W``'s dense arena, dequantized **once per (level, length,
    group) over all the layers** (one unpack and one affine map for all of them; then one copy
    per layer): int4 and int2 cost one more shift and mask, not more operations per chunk.
    Returns the number of chunks written."""
    g = C.geometry
    for l in layers:  # noqa: E741
        store = W.layers[l]
        if store is None or store.ragged:
            raise KVMemoryError(f"the working memory's layer {l} is not a dense arena")
    groups: dict[tuple[str, int, int], list[tuple[int, int, ChunkPayload]]] = {}
    ts = [t for t in (range(g.num_token_chunks) if only is None else sorted(only))
          if not (skip and t in skip)]
    lens = [g.chunk_len(t) for t in ts]
    resident = C.resident_payloads()
    for l in layers:  # noqa: E741
        for t, n in zip(ts, lens):
            for gg in range(g.num_groups):
                p = resident.get(KVChunkId(t, l, gg))
                if p is None:
                    continue
                if any(c != n for c in p.counts):
                    raise KVMemoryError(f"chunk {KVChunkId(t, l, gg)} is pruned; the context "
                                        "service keeps whole chunks")
                groups.setdefault((p.level, n, gg), []).append((l, t, p))
    written = 0
    d = g.head_dim
    hg = g.heads_per_group
    for (level, n, gg), items in groups.items():
        ks = _stack_values([p.k for _, _, p in items])
        vs = _stack_values([p.v for _, _, p in items])
        if level == "fp":
            k_all, v_all = ks, vs
        else:
            k_all, v_all = dequantize_fast(ks, W.dtype), dequantize_fast(vs, W.dtype)
        k_all = k_all.view(len(items), hg, n, d)
        v_all = v_all.view(len(items), hg, n, d)
        h0, h1 = g.head_range(gg)
        i = 0
        while i < len(items):          # items are layer-major, t ascending: one run per
            l, t_a, _ = items[i]  # noqa: E741   # layer and run of consecutive token chunks,
            j = i + 1                  # copied straight into the arena's slice (one copy)
            while (j < len(items) and items[j][0] == l and items[j][1] == t_a + (j - i)
                   and n == g.chunk_tokens):
                j += 1
            c = j - i
            s0 = t_a * g.chunk_tokens
            store = W.layers[l]
            assert store is not None and store.k is not None and store.v is not None
            store.k[0, h0:h1, s0:s0 + c * n].unflatten(1, (c, n)).copy_(
                k_all[i:j].permute(1, 0, 2, 3))
            store.v[0, h0:h1, s0:s0 + c * n].unflatten(1, (c, n)).copy_(
                v_all[i:j].permute(1, 0, 2, 3))
            written += c
            i = j
    for l in layers:  # noqa: E741
        store = W.layers[l]
        assert store is not None
        store.end = max(store.end, g.num_tokens)
    return written


def fill_token_chunk(W: ContextKV, f: Any) -> None:
    """Writes every layer of a token chunk file (a
    :class:`~sparkv.device.flashio.TokenChunkFile`) into ``W``'s dense arena: one
    dequantization of the whole file (the same values as :func:`fill_layers`, bit for bit), then
    one copy per layer and group."""
    g = W.geometry
    t0, t1 = g.token_range(f.t)
    n = t1 - t0
    k, v = f.k, f.v
    if f.level != "fp":
        k, v = dequantize_fast(k, W.dtype), dequantize_fast(v, W.dtype)
    k = k.view(f.layers, f.groups, f.heads, n, -1)
    v = v.view(f.layers, f.groups, f.heads, n, -1)
    for l in range(f.layers):  # noqa: E741
        store = W.layers[l]
        if store is None or store.ragged or store.k is None or store.v is None:
            raise KVMemoryError(f"the working memory's layer {l} is not a dense arena")
        for gg in range(f.groups):
            h0, h1 = g.head_range(gg)
            store.k[0, h0:h1, t0:t1] = k[l, gg]
            store.v[0, h0:h1, t0:t1] = v[l, gg]


def _remote_groups(remote: Any) -> int:
    return int(remote.geometry.num_groups)


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
            kpos = torch.arange(s)
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

    def __init__(self, lm: Any, tokens: Sequence[int], W: ContextKV, chunks: Sequence[int]) -> None:
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
        attn, _ = layer.self_attn(hidden_states=h, position_embeddings=self._pe,
                                  attention_mask=None, past_key_values=cache)
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

    read_chunks: int = 0          # token chunks read from flash
    streamed_chunks: int = 0      # token chunks restored from a remote source (the server)
    bytes_streamed: int = 0       # their decoded bytes
    stream_s: float = 0.0         # the remote fetch thread busy
    recomputed_chunks: int = 0    # token chunks recomputed
    resident_chunks: int = 0      # token chunks already in RAM
    files_read: int = 0
    bytes_read: int = 0
    faults: int = 0               # token chunks whose file failed (then recomputed)
    io_s: float = 0.0             # the I/O thread busy
    recompute_s: float = 0.0
    fill_s: float = 0.0           # dequantizing into the working memory
    wait_io_s: float = 0.0        # compute thread waiting for the I/O thread
    total_s: float = 0.0
    predicted_s: float = 0.0
    pipelined: bool = True
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def load(lm: Any, tokens: Sequence[int], C: ContextKV, W: ContextKV, tier: Any,
         read: Sequence[int], recompute: Sequence[int], *, pipeline: bool = True,
         io_threads: int = 4, on_layer: Callable[[], None] | None = None,
         level_of: Callable[[int], str] | None = None,
         store_recomputed: bool = True, stream: Sequence[int] = (), remote: Any = None,
         remote_chunks: Sequence[tuple[KVChunkId, str]] = ()) -> LoadStats:
    """Fills ``W`` with every layer of the context (module docstring).

    Args:
        read: token chunks to swap in from ``tier``: one read of each one's file (every layer,
            :func:`~sparkv.device.flashio.unpack_token_chunk`), ``io_threads`` files at a time.
        recompute: token chunks to recompute from ``tokens``.
        pipeline: overlap the reads with the work of the compute thread (the dequantization of
            the resident chunks and the recomputation: the planner recomputes the *earliest*
            missing chunks, whose queries attend over nothing that is being read); without it
            every read finishes before anything is filled (the "without pipeline" ablation and
            the chunk-swapping baselines).
        on_layer: called after each layer (the service checks its budget there).
        level_of: the level a recomputed token chunk is put into ``C`` at.
        store_recomputed: put the recomputed chunks into ``C`` (a new context's first prefill
            does not: its working memory becomes its memory).
        stream, remote, remote_chunks: token chunks restored from ``remote`` (a
            :class:`~sparkv.device.remote.RemoteSource`) by fetching ``remote_chunks`` (its
            chunks and levels), on a thread of their own beside the reads; they join ``C`` at
            their level as recomputed ones do. A chunk the remote fails to deliver is recomputed.
    """
    from sparkv.device.flashio import read_token_chunk_file

    g = C.geometry
    L = g.num_layers
    stats = LoadStats(pipelined=pipeline)
    start = time.perf_counter()
    refs: dict[int, Any] = {}
    failed: set[int] = set()      # reads / remote chunks that did not arrive
    absent: set[int] = set()
    for t in sorted(set(read) - set(recompute)):
        for cid in token_chunk_ids(g, t):
            st = C.state(cid)
            if st.residency != Residency.RESIDENT:
                if st.flash is None:
                    absent.add(t)       # nothing to read: recomputed below
                else:
                    refs[t] = st.flash
                break
    read = sorted(refs)
    lock = threading.Lock()
    io_window = [math.inf, 0.0]

    def read_one(t: int) -> None:
        t0 = time.perf_counter()
        try:
            data = tier.read(refs[t])
            f = read_token_chunk_file(data, t)
            if f.layers != L or f.groups != g.num_groups:
                raise PayloadError(f"token chunk {t}'s file has another geometry")
            for p in f.payloads:
                if C.residency(p.cid) != Residency.RESIDENT:
                    C.swap_in_payload(p)
            if C is not W:
                fill_token_chunk(W, f)     # here, in the reader: one dequantization per file
        except (FlashError, PayloadError, KVMemoryError):
            with lock:
                failed.add(t)
            return
        finally:
            with lock:
                io_window[0] = min(io_window[0], t0)
                io_window[1] = max(io_window[1], time.perf_counter())
        with lock:
            stats.files_read += 1
            stats.bytes_read += len(data)

    def wait(ts: Sequence[int]) -> None:
        w0 = time.perf_counter()
        for t in ts:
            futures[t].result()
        stats.wait_io_s += time.perf_counter() - w0

    stream = sorted(set(stream) - set(recompute) - set(read) - absent) \
        if remote is not None else []
    net_done = threading.Event()
    if not stream:
        net_done.set()

    def net_worker() -> None:
        """Fetches the remote chunks and writes their entries into W at their positions."""
        t0 = time.perf_counter()
        want = set(stream)
        T = g.chunk_tokens
        got: dict[int, int] = {}
        need = L * _remote_groups(remote)
        try:
            for cid, start, k, v in remote.fetch(remote_chunks):
                n = int(k.shape[1])
                h0, h1 = remote.geometry.head_range(cid.g)
                store = W.layers[cid.l]
                assert store is not None and store.k is not None and store.v is not None
                for t in range(start // T, -(-(start + n) // T)):
                    if t not in want:
                        continue
                    a, b = g.token_range(t)
                    store.k[0, h0:h1, a:b] = k[:, a - start:b - start].to(store.k.dtype)
                    store.v[0, h0:h1, a:b] = v[:, a - start:b - start].to(store.v.dtype)
                    got[t] = got.get(t, 0) + 1
                    with lock:
                        stats.bytes_streamed += int(k[:, a - start:b - start].numel()
                                                    * k.element_size() * 2)
        except Exception as e:  # noqa: BLE001 - a remote that fails: recompute what is missing
            stats.notes.append(f"remote: {e}")
        finally:
            with lock:
                failed.update(t for t in stream if got.get(t, 0) < need)
            stats.stream_s = time.perf_counter() - t0
            net_done.set()

    if stream:
        threading.Thread(target=net_worker, daemon=True, name="sparkv-device-net").start()
    rec = Recompute(lm, tokens, W, sorted(set(recompute) | absent))
    skip = set(rec.chunks)
    pool = ThreadPoolExecutor(max(1, min(io_threads, len(read)))) if read else None
    futures: dict[int, Any] = {}
    try:
        if pool is not None:
            futures = {t: pool.submit(read_one, t) for t in read}
            if not pipeline:
                wait(read)
        # chunks resident from the start: every layer at once (batched dequantization), while
        # the files are read
        f0 = time.perf_counter()
        if C is not W:
            fill_layers(C, W, range(L), skip | set(read) | set(stream))
        stats.fill_s += time.perf_counter() - f0
        # read chunks that a recomputed query attends over must be in W first
        last = max(rec.chunks) if rec.chunks else -1
        early = [t for t in read if t < last]
        late = [t for t in read if t >= last]
        if early:
            wait(early)
            if on_layer is not None:
                on_layer()
        if stream and rec.chunks and min(stream) < max(rec.chunks):
            w0 = time.perf_counter()
            net_done.wait()
            stats.wait_io_s += time.perf_counter() - w0
        for l in range(L):  # noqa: E741
            rec.layer(l)
            if on_layer is not None:
                on_layer()
        if late:
            wait(late)
            if on_layer is not None:
                on_layer()
        w0 = time.perf_counter()
        net_done.wait()
        stats.wait_io_s += time.perf_counter() - w0
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    if C is not W:
        for store in W.layers:
            if store is not None:
                store.end = max(store.end, g.num_tokens)
    if read:
        stats.io_s = max(0.0, io_window[1] - io_window[0])
    recompute = sorted(skip)
    streamed = set(stream) - failed
    stats.recompute_s = rec.seconds
    if failed:
        # the fault path: a file that is missing or fails its checksum is recomputed (every
        # other chunk of every layer is in W now, so one more pass is exact)
        # (recomputed chunks after the first failed one attended over its unread positions:
        # they are recomputed again)
        stats.faults = len(failed)
        stats.notes.append(f"{len(failed)} token chunks failed to read and were recomputed")
        first = min(failed)
        fix = Recompute(lm, tokens, W, sorted(failed | {t for t in recompute if t > first}))
        for l in range(L):  # noqa: E741
            fix.layer(l)
        stats.recompute_s += fix.seconds
        recompute = sorted(set(recompute) | failed)
    # recomputed (and streamed) chunks join C at their level (only where C does not hold them)
    for t in sorted(set(recompute) | streamed) if store_recomputed else []:
        level = level_of(t) if level_of is not None else "int8"
        for l in range(L):  # noqa: E741
            for gg in range(g.num_groups):
                cid = KVChunkId(t, l, gg)
                if C.residency(cid) != Residency.RESIDENT:
                    C.put_payload(chunk_payload(W, cid, level), source=Source.COMPUTED)
        if on_layer is not None:
            on_layer()
    stats.read_chunks = len(set(read) - failed)
    stats.streamed_chunks = len(streamed)
    stats.recomputed_chunks = len(set(recompute))
    stats.total_s = time.perf_counter() - start
    return stats
