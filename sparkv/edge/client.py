"""The device's REST client: :class:`EdgeClient` (docs/rest-api.md). REST only: it knows the
server's JSON endpoints and nothing of models, plans or priors (those are the session's,
:class:`~sparkv.edge.session.EdgeSession`).

    client = EdgeClient("http://127.0.0.1:8080", api_key=KEY)
    cid = client.create_context(text=document)
    manifest = client.manifest(cid)            # sparkv.protocol.Manifest
    tokens = client.tokens(cid)

Requests go through one keep-alive ``httpx.Client``. Every body byte read from the server passes
through the client's :class:`~sparkv.edge.shaper.LinkShaper` (unlimited unless a trace is given),
so manifest and token downloads pay the emulated link like the chunks do (the chunk stream is
read by :class:`~sparkv.edge.http_source.HttpChunkSource`, made by :meth:`EdgeClient.chunk_source`
with the same URL, key and shaper).

The client remembers, per context, the manifest and the token ids (in memory, and on disk under
``cache_dir`` when given): a device that asked about a context once can still answer questions
about it (computing everything locally) when the server is unreachable.

Errors: :class:`~sparkv.protocol.errors.ApiError` (the server answered an error: ``status``,
``code``, ``message``; a redirect, which the client never follows, is one too: code
``redirect``), :class:`~sparkv.protocol.errors.ServerUnavailable` (no answer), and
:class:`~sparkv.protocol.errors.ManifestError` (a manifest that breaks the contract, or token ids
outside the model's vocabulary).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx

from sparkv.edge.bounds import (BadEncoding, BoundedBody, ClientLimits, Deadline,
                                DeadlineBackend, DeadlineExceeded, ResponseTooLarge,
                                answer_error, deadline_transport, out_of_vocabulary,
                                tokens_limit)
from sparkv.edge.http_source import HttpChunkSource, preconnect
from sparkv.edge.wire import Preconnect
from sparkv.edge.shaper import LinkShaper
from sparkv.protocol import Manifest
from sparkv.protocol.digests import tokens_digest, tokens_from_bytes
from sparkv.protocol.errors import ApiError, ManifestError, ServerUnavailable

__all__ = ["EdgeClient", "Fetched", "ClientLimits", "ApiError", "ServerUnavailable",
           "ResponseTooLarge", "DeadlineExceeded", "BadEncoding"]


#: how long a job poll is retried while the server takes it but answers late (seconds)
SILENT_POLL_S = 300.0


@dataclass
class Fetched:
    """A body read through the shaper, with its timings (seconds since the request was sent);
    ``first_piece_bytes``: the wire bytes of its first read, in by ``first_read_s``, whose
    first byte crossed the link at ``first_byte_s`` (the request's round trip, and the server's
    time to answer)."""

    body: bytes
    seconds: float
    first_read_s: float
    headers: dict[str, str]
    wire_bytes: int = 0
    first_piece_bytes: int = 0
    first_byte_s: float = 0.0

    def rate_Bps(self) -> float | None:  # noqa: N802
        """The link's rate while the body came: the bytes after its first read over the time
        after it, or ``None`` when fewer than :data:`RATE_TAIL_BYTES` followed it. The first
        read's bytes were in by ``first_read_s``: counted over the rest of the time, a 67 kB
        manifest whose first 64 KiB came in one read measured a 10 Mbit/s link at 268-427
        Mbit/s (session 80, 4K contexts), and the next first ask planned for that."""
        tail, span = self.wire_bytes - self.first_piece_bytes, self.seconds - self.first_read_s
        return tail / span if tail >= RATE_TAIL_BYTES and span > 0 else None


#: the bytes that must follow a body's first read for its rate to be read (:meth:`Fetched.rate_Bps`)
RATE_TAIL_BYTES = 32 << 10


#: how long :meth:`EdgeClient.frame` keeps retrying a retryable failure: past nginx's 3 s
#: ``fail_timeout`` (deploy/nginx.conf), the longest a balancer answers 502 for a dead replica
FRAME_RETRY_WINDOW_S = 4.0


class QualityWarning(UserWarning):
    """The server stored a context compressed by a press that fails the model's quality table
    (``quality_warning`` of ``POST /v1/contexts``): its answers are inferior to the uncompressed
    context's with 95% confidence."""


class EdgeClient:
    """REST client of one sparkv server.

    Args:
        server_url: e.g. ``http://127.0.0.1:8080``.
        api_key: the tenant's key (``None`` for an anonymous loopback server).
        shaper: link emulation for every byte read (default: unlimited).
        timeout_s: connect timeout, and the longest silence within one request.
        cache_dir: where to keep manifests and token ids between runs (``None``: memory only).
        limits: the bounds of every body and every request's deadline (default
            :class:`~sparkv.edge.bounds.ClientLimits`: 16 MiB manifests, 60 s).
    """

    def __init__(self, server_url: str, api_key: str | None = None, *,
                 shaper: LinkShaper | None = None, timeout_s: float = 10.0,
                 cache_dir: str | os.PathLike[str] | None = None,
                 limits: ClientLimits | None = None) -> None:
        self.base_url = server_url.rstrip("/")
        self.api_key = api_key
        self.shaper = shaper or LinkShaper.unlimited()
        self.timeout_s = float(timeout_s)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.limits = limits or ClientLimits()
        self._backend = DeadlineBackend()
        try:
            self._http = httpx.Client(
                base_url=self.base_url,
                headers={**self.auth_headers(), "Accept-Encoding": "identity"},
                timeout=httpx.Timeout(self.timeout_s, connect=self.timeout_s),
                transport=deadline_transport(self._backend))
        except httpx.InvalidURL as e:   # a host IDNA refuses, a port out of range, ...
            raise ValueError(f"not a server URL: {server_url!r} ({e})") from None
        try:
            _check_host(self._http.base_url, server_url)
        except ValueError:
            self._http.close()
            raise
        self._manifests: dict[str, Manifest] = {}
        self._tokens: dict[str, list[int]] = {}
        #: the last shaped download of at least 64 KiB (what the link did then; not an estimator)
        self.last_download: Fetched | None = None
        #: the time to the first body byte of the last shaped request (seconds): when it crossed
        #: the link (:attr:`Fetched.first_byte_s`), the plan's round trip
        self.last_first_byte_s: float = 0.0
        #: per thread, its shaped requests' wire bytes and seconds, summed (:meth:`shaped_totals`)
        self._shaped = threading.local()
        #: context id -> encryption key (base64url), for encrypted contexts
        self.encryption_keys: dict[str, str] = {}
        #: per context id, the server's ``quality_warning`` (a press that fails the model's
        #: quality table; docs/quality.md), also raised as a :class:`QualityWarning`
        self.quality_warnings: dict[str, str] = {}
        #: idempotent reads retried by :meth:`frame` (a replica died or was restarting)
        self.frame_retries = 0

    # ---- plumbing ----------------------------------------------------------------------------
    def shaped_totals(self) -> tuple[int, float]:
        """``(wire bytes, seconds)`` of the calling thread's shaped requests so far, summed: a
        caller takes the difference over its own requests (sparkv.edge.fetch). Per thread: the
        device service's concurrent asks share one client, each on its own thread."""
        return getattr(self._shaped, "totals", (0, 0.0))

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def chunk_source(self, context_id: str, *, connect_timeout_s: float = 3.0,
                     read_timeout_s: float = 10.0,
                     ahead: Preconnect | None = None) -> HttpChunkSource:
        """The HTTP chunk source of ``context_id`` (same URL, key and shaper as this client;
        ``ahead``: connections :meth:`preconnect` opened, which its first requests adopt)."""
        return HttpChunkSource(self.base_url, context_id, self.auth_headers(), shaper=self.shaper,
                               connect_timeout_s=connect_timeout_s,
                               read_timeout_s=read_timeout_s, ahead=ahead)

    def preconnect(self, connect_timeout_s: float = 3.0) -> Preconnect | None:
        """Two connections to the server opened now, by threads of their own, for a chunk
        source's first requests (:meth:`chunk_source` ``ahead``): an ask opens them while it
        fetches the manifest and plans, so its load's first request, and the one it sends while
        the first drains, pay no TCP handshake (a round trip each; docs/edge.md, "The load's
        connections are opened at the ask's start"). ``None`` where the stream goes through a
        proxy (``httpx`` carries it) or the URL is not a well-formed http(s) one."""
        return preconnect(self.base_url, connect_timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EdgeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, limit: int, shaped: bool = True,
                 headers: dict[str, str] | None = None, **kw: Any) -> Fetched:
        """One request within the deadline (:attr:`limits`), its body read through the shaper
        and bounded by ``limit`` bytes (decoded). Raises :class:`ServerUnavailable` (also
        :class:`ResponseTooLarge`, :class:`DeadlineExceeded`, :class:`BadEncoding`) or
        :class:`ApiError`."""
        start = time.perf_counter()
        not_before = self.shaper.request_started() if shaped else None
        what = f"{method} {path}"
        with self._backend.within(self.limits.deadline_s) as deadline:
            try:
                with self._http.stream(method, path, headers=headers, **kw) as r:
                    body, first = self._read_body(r, what, limit, deadline, start, not_before)
            except (httpx.TransportError, OSError, EOFError) as e:
                if deadline.expired() or (isinstance(e, httpx.TimeoutException)
                                          and deadline.binding):
                    raise self._late(what, deadline) from e
                raise ServerUnavailable(f"cannot reach the server at {self.base_url}: "
                                        f"{type(e).__name__}: {e}",
                                        silent=isinstance(e, httpx.ReadTimeout)) from e
        if r.status_code >= 300:
            raise answer_error(r.status_code, body.body(), r.headers.get("location"), what)
        total = time.perf_counter() - start
        read_s, first_bytes, byte_s = first if first is not None else (total, 0, total)
        fetched = Fetched(body.body(), total, read_s, dict(r.headers), body.wire_bytes,
                          first_bytes, byte_s)
        if shaped:
            self.last_first_byte_s = byte_s
            nbytes, seconds = self.shaped_totals()
            self._shaped.totals = (nbytes + fetched.wire_bytes, seconds + total)
            if fetched.rate_Bps() is not None:
                self.last_download = fetched
        return fetched

    def _read_body(self, r: httpx.Response, what: str, limit: int, deadline: Deadline,
                   start: float, not_before: float | None
                   ) -> tuple[BoundedBody, tuple[float, int, float] | None]:
        """The body of ``r`` (an error's: its first :attr:`ClientLimits.error_bytes`) and its
        first read's timing (``None``: an empty body): the time it was in by, its wire bytes
        and the time its first byte crossed the link (:meth:`LinkShaper.take`)."""
        encoding = r.headers.get("content-encoding", "identity").lower()
        if encoding not in ("gzip", "identity", ""):
            raise ApiError(r.status_code, "bad_encoding",
                           f"unsupported Content-Encoding {encoding!r}")
        error = r.status_code >= 300     # an error's or a redirect's body: its start only
        body = BoundedBody(self.limits.error_bytes if error else limit, what,
                           gzip=encoding == "gzip", truncate=error)
        first: tuple[float, int, float] | None = None
        for piece in r.iter_raw(65536):  # wire bytes: what the link carries
            crossed = time.perf_counter()
            if not_before is not None:
                crossed = self.shaper.take(len(piece), not_before)
            if first is None:
                first = (time.perf_counter() - start, len(piece), crossed - start)
            body.feed(piece)
            if body.full:
                break
            if deadline.expired():
                raise self._late(what, deadline)
        return body, first

    def _late(self, what: str, deadline: Deadline) -> DeadlineExceeded:
        return DeadlineExceeded(f"{what}: the server at {self.base_url} did not answer within "
                                f"the request deadline ({deadline.seconds:g} s)")

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        f = self._request(method, path, limit=self.limits.json_bytes, **kw)
        try:
            return json.loads(f.body)
        except ValueError as e:
            raise ApiError(200, "bad_json", f"{path} did not return JSON: {e}") from e

    # ---- REST --------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return self._json("GET", "/healthz", shaped=False)

    def create_context(self, *, text: str | None = None, token_ids: Sequence[int] | None = None,
                       levels: Sequence[str] | None = None, chunk_tokens: int | None = None,
                       heads_per_group: int = 0, model: str | None = None, wait: bool = True,
                       encrypt: bool = False, timeout_s: float = 900.0,
                       progress: bool = False, press: str | None = None,
                       name: str | None = None) -> str:
        """Asks the server to encode a context; with ``wait``, polls its job until it is done.
        With ``encrypt`` the frames are stored AES-GCM-encrypted; the key the server returns
        (once) is kept in :attr:`encryption_keys`. With ``press`` (``NAME:RATIO``,
        ``NAME:PCT%``, ``NAME:TOKENSt``) the server compresses the context question-agnostically
        and stores only the kept entries: a different context id from the uncompressed one
        (docs/presses.md, "On the server"). A press that fails the model's quality table is
        stored anyway: the server's warning is kept in :attr:`quality_warnings` and raised as a
        :class:`QualityWarning` (docs/quality.md). ``name`` labels the context (listed by
        :meth:`list_contexts`; not part of its id)."""
        body: dict[str, Any] = {"heads_per_group": heads_per_group, "encrypt": bool(encrypt)}
        if name is not None:
            body["name"] = name
        if press is not None:
            body["press"] = str(press)
        if text is not None:
            body["text"] = text
        if token_ids is not None:
            body["token_ids"] = [int(x) for x in token_ids]
        if levels is not None:
            body["levels"] = list(levels)
        if chunk_tokens is not None:
            body["chunk_tokens"] = int(chunk_tokens)
        if model is not None:
            body["model"] = model
        # the server loads the model at its first use, within this request: silence up to the
        # request's deadline is not a dead server (seen: > 10 s on a loaded 2-core machine)
        r = self._json("POST", "/v1/contexts", json=body, shaped=False,
                       timeout=httpx.Timeout(self.timeout_s, read=self.limits.deadline_s))
        cid = str(r["context_id"])
        if r.get("encryption_key"):
            self.encryption_keys[cid] = str(r["encryption_key"])
        if r.get("quality_warning"):
            self.quality_warnings[cid] = str(r["quality_warning"])
            warnings.warn(QualityWarning(str(r["quality_warning"])), stacklevel=2)
        if token_ids is not None:
            self._tokens[cid] = [int(x) for x in token_ids]
        if not wait or r.get("status") == "done":
            return cid
        deadline = time.monotonic() + timeout_s
        last = -1.0
        while time.monotonic() < deadline:
            job = self._poll_job(str(r["job_id"]), deadline)
            state = job.get("state")
            if state == "done":
                return cid
            if state in ("failed", "cancelled"):
                raise ApiError(500, f"job_{state}", str(job.get("error")))
            frac = float((job.get("progress") or {}).get("fraction", 0.0))
            if progress and frac - last >= 0.1:
                print(f"  encoding on the server: {job.get('phase')} {100 * frac:.0f}%", flush=True)
                last = frac
            time.sleep(0.2)
        raise ApiError(504, "job_timeout", f"context {cid} was not encoded in {timeout_s:.0f} s")

    def list_contexts(self) -> dict[str, Any]:
        """``GET /v1/contexts``: ``{"contexts": [...], "pending": [...]}``, each complete context
        with its ``context_id``, ``name``, ``num_tokens``, ``model``, ``levels``, ``press``,
        ``encrypted`` and ``created_unix`` (docs/rest-api.md)."""
        return dict(self._json("GET", "/v1/contexts", shaped=False))

    def delete_context(self, context_id: str) -> None:
        """``DELETE /v1/contexts/{id}`` (its encode job cancelled); an :class:`ApiError` 404
        ``context_not_found`` when there is none. Forgets what this client cached of it."""
        self._request("DELETE", f"/v1/contexts/{context_id}", limit=self.limits.json_bytes,
                      shaped=False)
        self._tokens.pop(context_id, None)
        self._manifests.pop(context_id, None)
        cached = self._cache_path(context_id)
        if cached is not None:
            shutil.rmtree(cached, ignore_errors=True)

    def _poll_job(self, job_id: str, deadline: float) -> dict[str, Any]:
        """The job's state. A poll the server does not answer is retried within ``deadline``:
        for up to three request timeouts (at least 30 s) in a row while the server cannot be
        reached (refused, reset: it is down), and for up to :data:`SILENT_POLL_S` while it takes
        the poll but answers late (a read timeout: a server busy encoding on a loaded machine, or
        a GPU server's first prefill, answers polls late while the job goes on)."""
        start = time.monotonic()
        down_s = max(30.0, 3 * self.timeout_s)
        while True:
            try:
                return self._json("GET", f"/v1/jobs/{job_id}", shaped=False)
            except ServerUnavailable as e:
                waited = time.monotonic() - start
                if time.monotonic() >= deadline or waited >= (
                        max(SILENT_POLL_S, down_s) if e.silent else down_s):
                    raise
                time.sleep(0.5)

    def pressed_context(self, context_id: str, press: str, *, wait: bool = True,
                        timeout_s: float = 900.0, progress: bool = False) -> str:
        """The id of the compressed variant of stored context ``context_id`` under ``press``:
        its token ids are sent again (``POST /v1/contexts``) with the same model, geometry,
        levels and encryption, plus the press. The server derives the id from all of that, so a
        variant encoded before is found, not encoded again (200); otherwise this waits for its
        job (with ``wait``)."""
        m = self.manifest(context_id)
        if m.press is not None:
            raise ApiError(400, "already_compressed",
                           f"context {context_id} is already compressed ({m.press.spec})")
        tokens = self.tokens(context_id)
        g = m.geometry
        hpg = 0 if g.heads_per_group == g.num_kv_heads else g.heads_per_group
        return self.create_context(token_ids=tokens, levels=list(m.levels),
                                   chunk_tokens=g.chunk_tokens, heads_per_group=hpg,
                                   model=m.model.name, wait=wait, encrypt=m.encrypted,
                                   timeout_s=timeout_s, progress=progress, press=press)

    def _cache_path(self, context_id: str) -> Path | None:
        if self.cache_dir is None:
            return None
        host = hashlib.sha256(self.base_url.encode()).hexdigest()[:12]
        return self.cache_dir / host / context_id

    def manifest(self, context_id: str, *, use_cache: bool = True) -> Manifest:
        """The context's manifest (from memory or disk when ``use_cache``, else the server; at
        most :attr:`ClientLimits.manifest_bytes`, declaring at most
        :attr:`ClientLimits.max_context_tokens` tokens)."""
        if use_cache and context_id in self._manifests:
            return self._manifests[context_id]
        path = self._cache_path(context_id)
        if use_cache and path is not None and (path / "manifest.json").is_file():
            try:
                m = self._checked(Manifest.parse((path / "manifest.json").read_bytes()))
            except ManifestError:
                m = None   # a damaged cache entry: fetch it again
            if m is not None and m.context_id == context_id:
                self._manifests[context_id] = m
                return m
        f = self._request("GET", f"/v1/contexts/{context_id}", limit=self.limits.manifest_bytes,
                          headers={"Accept-Encoding": "gzip"})
        m = self._checked(Manifest.parse(f.body))
        if m.context_id != context_id:
            raise ManifestError(f"asked for {context_id}, the server sent {m.context_id}")
        self._manifests[context_id] = m
        if path is not None:
            _write_atomic(path / "manifest.json", f.body)
        return m

    def _checked(self, m: Manifest) -> Manifest:
        """``m``, unless it declares more tokens than :attr:`limits` allow."""
        if m.num_tokens > self.limits.max_context_tokens:
            raise ManifestError(f"context {m.context_id} declares {m.num_tokens} tokens; this "
                                f"client accepts at most {self.limits.max_context_tokens} "
                                "(ClientLimits.max_context_tokens)")
        return m

    def frame(self, context_id: str, t: int, l: int, g: int, level: str, *,  # noqa: E741
              retries: int = 3, retry_window_s: float = FRAME_RETRY_WINDOW_S,
              shaped: bool = True) -> bytes:
        """One stored frame (``GET .../chunks/{t}/{l}/{g}?level=``), at most the manifest's
        size for it, an idempotent read: a transport error (a replica that died mid-answer) or
        a retryable 5xx/429 is retried at least ``retries`` times and for ``retry_window_s``
        (through a balancer, on another replica: nginx marks a replica that failed once down
        for 3 s, deploy/nginx.conf, and answers 502 while every replica is marked down; three
        quick retries spanned 0.35 s of it, and a loaded run of the suite saw a reader fail
        after one replica was killed); ``frame_corrupt`` is not (every replica reads the same
        store), nor a body over its size or a request past its deadline. Raises
        ServerUnavailable or ApiError."""
        path = f"/v1/contexts/{context_id}/chunks/{int(t)}/{int(l)}/{int(g)}"
        start, attempt = time.perf_counter(), 0
        while True:
            try:
                limit = _frame_limit(self.manifest(context_id), int(t), int(l), int(g), level)
                return self._request("GET", path, limit=limit, params={"level": level},
                                     shaped=shaped).body
            except (ServerUnavailable, ApiError) as e:
                last = attempt >= retries and time.perf_counter() - start >= retry_window_s
                if last or isinstance(e, (ResponseTooLarge, DeadlineExceeded, BadEncoding)) or (
                        isinstance(e, ApiError) and (not e.retryable or
                                                     e.code == "frame_corrupt")):
                    raise
                self.frame_retries += 1
                time.sleep(min(0.5, 0.05 * 2 ** attempt))
                attempt += 1

    def tokens(self, context_id: str, *, use_cache: bool = True,
               vocab_size: int | None = None) -> list[int]:
        """The context's token ids (needed to compute chunks locally): a body of at most
        ``4 * num_tokens`` bytes (plus slack) of the context's manifest, fetched first if this
        client does not hold it. With ``vocab_size`` (the model's), a server's ids outside
        ``0 .. vocab_size - 1`` are a :class:`ManifestError` and are not kept (a disk cache entry
        with such ids is fetched again)."""
        if use_cache and context_id in self._tokens:
            return self._tokens[context_id]
        path = self._cache_path(context_id)
        if use_cache and path is not None and (path / "tokens.u32").is_file():
            try:
                ids = tokens_from_bytes((path / "tokens.u32").read_bytes())
            except ValueError:
                ids = None   # a damaged cache entry: fetch them again
            if ids is not None and (vocab_size is None
                                    or out_of_vocabulary(ids, vocab_size) is None):
                self._tokens[context_id] = ids
                return ids
        limit = tokens_limit(self.manifest(context_id).num_tokens)
        f = self._request("GET", f"/v1/contexts/{context_id}/tokens", limit=limit)
        try:
            ids = tokens_from_bytes(f.body)
        except ValueError as e:
            raise ApiError(200, "bad_tokens", str(e)) from e
        want = f.headers.get("x-sparkv-tokens-sha256")
        if want and tokens_digest(ids) != want:
            raise ManifestError("the token ids do not match their digest")
        outside = out_of_vocabulary(ids, vocab_size) if vocab_size is not None else None
        if outside is not None:
            raise ManifestError(f"the server's token ids of context {context_id} are not this "
                                f"model's: {outside}")
        self._tokens[context_id] = ids
        if path is not None:
            _write_atomic(path / "tokens.u32", f.body)
        return ids

    def known_tokens(self, context_id: str) -> list[int] | None:
        """The context's token ids if the device already holds them (no request)."""
        return self._tokens.get(context_id)

    def known_manifest(self, context_id: str) -> Manifest | None:
        """The manifest this client already fetched (no request)."""
        return self._manifests.get(context_id)

    def remember_tokens(self, context_id: str, token_ids: Sequence[int]) -> None:
        """The device holds the context itself (e.g. the document is on the phone)."""
        self._tokens[context_id] = [int(x) for x in token_ids]


def _frame_limit(m: Manifest, t: int, l: int, g: int, level: str) -> int:  # noqa: E741
    """The manifest's size of frame ``(t, l, g)`` at ``level`` (its largest frame when it does
    not list that one: the server then answers an error)."""
    entry = m.index.get((t, l, g, level))
    if entry is not None:
        return entry.bytes
    return max((e.bytes for e in m.index.values()), default=1)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _check_host(url: httpx.URL, server_url: str) -> None:
    """A :class:`ValueError` for a host no resolver takes: an ``xn--`` label that is no IDNA
    (``httpx`` raises decoding it), a label over 63 characters or empty (the IDNA codec refuses
    it only when the first connection resolves it, mid-ask)."""
    try:
        host = url.host
        if host.startswith("[") or not host:
            return
        host.encode("idna")
    except UnicodeError as e:
        raise ValueError(f"not a server URL: {server_url!r} ({e})") from None
