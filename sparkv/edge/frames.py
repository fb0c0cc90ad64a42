"""The engine's decode path: a received frame, decrypted and decoded straight into the KV memory
on a small worker pool, or by the compute thread between its calls where no core is spare (the
codec checks the frame's checksum, and that every value is finite in the memory's dtype: a NaN
or an infinity is never attended over); a frame that cannot be used is reported, and its chunk
is computed locally.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

from sparkv.cache import ContextKV
from sparkv.edge.hub import EngineConfig, Hub
from sparkv.edge.results import TransferLog
from sparkv.edge.stats import EngineStats
from sparkv.layout import KVChunkId
from sparkv.runtime.threads import use_threads
from sparkv.scheduler.controller import Fetch

FrameOpener = Callable[[bytes, KVChunkId, str], bytes]
"""``(stored bytes, chunk, level) -> codec frame`` (decrypts an encrypted context's frames)."""

KeptEntries = tuple[Sequence[int], Sequence[Any]]
"""A compressed chunk's kept entries: ``(counts per head, absolute positions per head)``."""


def decode_in_turn(device: Any, threads: int) -> bool:
    """Whether received frames are best decoded by the compute thread between its calls: on a
    CPU whose every usable core runs the compute's ``threads`` OpenMP threads. A decode worker
    beside them preempts one, and the team waits for it at every barrier: on the 2-core CPU a
    background thread using ~29% of one core slowed the layer steps by ~59%
    (``python bench/contention.py``), and a streaming load's compute calls ran 1.6-1.9x their
    time alone at 100 Mbit/s (``bench/compute_replay.py``; docs/edge.md, "Decoding in turn").
    A GPU's steps leave the host's cores to the decoder."""
    if getattr(device, "type", "cpu") != "cpu":
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return threads >= cores


def decodes_in_turn(config: EngineConfig | None, device: Any, threads: int) -> bool:
    """Whether a load decodes in turn: ``config.decode_in_turn`` where it says, else
    :func:`decode_in_turn` (the engine runs by it, the plan is priced by it)."""
    if config is not None and config.decode_in_turn is not None:
        return bool(config.decode_in_turn)
    return decode_in_turn(device, threads)


class FrameDecoder:
    """Decodes received frames into the KV memory on a pool of ``workers`` threads
    (``sparkv-decode``), or, *in turn*, on the compute thread between its calls
    (:meth:`decode_queued`), then tells the controller (``chunk_arrived``).

    State and lock discipline:

    * ``_pending`` (frames handed over and not yet decoded): under the engine's lock; the link
      loop adds one (:meth:`submit`), a decode worker takes it away; the compute worker's stall
      and idle rules read it (:meth:`busy`);
    * ``_copier``: made by the first decode worker that needs one (a single worker by default);
    * every decode worker takes the engine's lock once per frame, to record the outcome, call the
      controller and signal :meth:`Hub.progress <sparkv.edge.hub.Hub.progress>` (a chunk in
      place may let the compute worker run a step, and the link pull more).

    Args:
        kept: a compressed context's kept entries per chunk (see :func:`put_kept`); a streamed
            frame of such a chunk holds only those rows.
    """

    def __init__(self, hub: Hub, kv: ContextKV, stats: EngineStats, workers: int,
                 open_frame: FrameOpener | None = None,
                 kept: Mapping[KVChunkId, KeptEntries] | None = None) -> None:
        self._hub, self._kv, self._stats = hub, kv, stats
        self._workers = workers
        self._open_frame = open_frame
        self._kept = dict(kept) if kept else {}
        self._pending = 0
        self._in_turn = False
        self._queue: deque[tuple[Fetch, bytes, TransferLog]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._copier: _DeviceCopier | None = None
        self._copier_known = False

    def start(self, warm: bool, in_turn: bool = False) -> None:
        """Starts the pool, each worker with one OpenMP thread (its dequantisation must not take
        the cores the layer steps use: sparkv.runtime.threads); ``warm``: start the workers now
        (before the compute thread, whose thread count they must not change). ``in_turn``: no
        pool; the compute thread decodes the frames (:meth:`decode_queued`)."""
        self._in_turn = in_turn
        if in_turn:
            return
        self._pool = ThreadPoolExecutor(max_workers=self._workers,
                                        thread_name_prefix="sparkv-decode",
                                        initializer=use_threads, initargs=(1,))
        if warm:
            for f in [self._pool.submit(int) for _ in range(self._workers)]:
                f.result()

    def shutdown(self) -> None:
        """Waits for the frame being decoded; frames not started are dropped."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self._hub.cv:
            self._queue.clear()

    def submit(self, f: Fetch, data: bytes, log: TransferLog) -> None:
        """Under the engine's lock: ``data``, ``f``'s whole frame, to a decode worker, or to the
        compute thread's queue (woken: it decodes before its next call)."""
        self._pending += 1
        if self._in_turn:
            self._queue.append((f, data, log))
            self._hub.cv.notify_all()
            return
        assert self._pool is not None
        self._pool.submit(self._decode, f, data, log)

    @property
    def queued(self) -> bool:
        """Under the engine's lock: frames wait for the compute thread (in turn)."""
        return bool(self._queue)

    def decode_queued(self) -> int:
        """On the compute thread, outside the engine's lock: decodes the frames waiting for it,
        oldest first; returns how many."""
        n = 0
        while True:
            with self._hub.cv:
                if not self._queue:
                    return n
                f, data, log = self._queue.popleft()
            self._decode(f, data, log)
            n += 1

    def busy(self) -> bool:
        """Under the engine's lock: whether a frame is waiting or being decoded."""
        return self._pending > 0

    def _decode(self, f: Fetch, data: bytes, log: TransferLog) -> None:
        from sparkv.codec import CodecError

        start = time.perf_counter()
        try:
            frame = self._open_frame(data, f.cid, f.level) if self._open_frame else data
            why = self._place(f.cid, frame)
        except CodecError as e:
            why = f"bad frame: {e}"
        except Exception as e:  # noqa: BLE001 - decryption, layout: recompute locally
            why = f"{type(e).__name__}: {e}"
        hub = self._hub
        with hub.cv:
            self._pending -= 1
            self._stats.decoded(log, hub.now(), time.perf_counter() - start, len(data), why)
            if why is None:
                hub.ctl.chunk_arrived(f.cid, log.decoded_s)
            hub.progress()

    def _place(self, cid: KVChunkId, frame: bytes) -> str | None:
        """Decodes ``frame`` into the KV memory as ``cid``; returns why it cannot be used, or
        ``None`` (a chunk a computed step already produced is not overwritten)."""
        from sparkv.codec import decode, decode_into, peek_header

        if cid in self._kept:
            chunk = decode(frame, finite=True, dtype=self._kv.dtype)
            if chunk.id != cid:
                return _misnamed(chunk.id, cid)
            return put_kept(self._kv, cid, self._kept[cid], chunk.k, chunk.v)
        copier = self._to_device()
        if copier is None:
            chunk = decode(frame, finite=True, dtype=self._kv.dtype)
            if chunk.id != cid:
                return _misnamed(chunk.id, cid)
            self._kv.put(cid, chunk.k, chunk.v, source="streamed", overwrite=False)
            return None
        hdr = peek_header(frame)
        k, v = copier.buffers(tuple(hdr.shape), self._kv.dtype)
        decode_into(frame, k, v, finite=True)
        if hdr.chunk_id != cid:
            return _misnamed(hdr.chunk_id, cid)
        copier.put(self._kv, cid, k, v)
        return None

    def _to_device(self) -> "_DeviceCopier | None":
        """How decoded chunks reach a GPU memory: pinned staging + an asynchronous copy on a
        copy stream (``None`` on the CPU, and on unified memory where there is nothing to copy)."""
        if not self._copier_known:
            from sparkv.runtime.device import unified_memory

            dev = self._kv.device
            self._copier = (_DeviceCopier(dev) if dev.type == "cuda" and not unified_memory()
                            else None)
            self._copier_known = True
        return self._copier


def _misnamed(got: KVChunkId, want: KVChunkId) -> str:
    return f"frame names {got}, expected {want}"


def put_kept(kv: ContextKV, cid: KVChunkId, kept: KeptEntries, k: Any, v: Any) -> str | None:
    """A compressed chunk's decoded rows (``k``, ``v``: ``[1, sum(counts), D]``) into ``kv`` as a
    payload with the manifest's counts and absolute positions per head (``kept``: the chunk's
    entry of :attr:`Manifest.kept_positions <sparkv.protocol.Manifest.kept_positions>`);
    returns why they cannot be used, or ``None``. A chunk computed locally first stays whole
    (the caller prunes every layer to the same positions once loading completes)."""
    import torch

    from sparkv.cache import ChunkPayload

    counts, pos = kept
    rows = int(sum(counts))
    want = (1, max(rows, 1), kv.geometry.head_dim)
    if tuple(k.shape) != want:
        return f"layout: the frame holds {tuple(k.shape)} values, the manifest keeps {want}"
    if kv.has(cid):
        return None
    positions = (torch.cat([torch.as_tensor(p, dtype=torch.int32) for p in pos])
                 if pos else torch.zeros(0, dtype=torch.int32))
    dev, dt = kv.device, kv.dtype
    payload = ChunkPayload(cid, "fp", [int(c) for c in counts], positions.to(dev),
                           k[0, :rows].to(device=dev, dtype=dt).contiguous(),
                           v[0, :rows].to(device=dev, dtype=dt).contiguous(), dt)
    kv.put_payload(payload, source="streamed")
    return None


class _DeviceCopier:
    """Decoded chunks into GPU memory: the decode worker decodes into pinned host buffers and
    copies them with one asynchronous copy on its own CUDA stream, which it waits for before the
    chunk is reported (the compute thread's kernels keep running meanwhile)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self._pool: dict[tuple[tuple[int, ...], Any], tuple[Any, Any]] = {}

    def buffers(self, shape: tuple[int, ...], dtype: Any) -> tuple[Any, Any]:
        key = (shape, dtype)
        if key not in self._pool:
            mk = self.torch.empty
            self._pool[key] = (mk(shape, dtype=dtype, pin_memory=True),
                               mk(shape, dtype=dtype, pin_memory=True))
        return self._pool[key]

    def put(self, kv: Any, cid: KVChunkId, k: Any, v: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            kv.put(cid, k, v, source="streamed", overwrite=False, non_blocking=True)
        self.stream.synchronize()       # the pinned buffers are reused by the next chunk
