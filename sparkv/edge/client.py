"""The device's REST client: :class:`EdgeClient` (docs/rest-api.md).

    client = EdgeClient("http://127.0.0.1:8080", api_key=KEY)        # bundled SmolLM2
    result = client.ask(context_id, "What does the licence say about warranty?")
    print(result.answer); print(result.breakdown.table())

JSON requests (manifest, tokens, jobs) go through one keep-alive ``httpx.Client``; the bulk KV
stream is read by the engine's asyncio path (:mod:`sparkv.edge.engine`) with the same base URL and
key. Every body byte read from the server passes through the client's
:class:`~sparkv.edge.shaper.LinkShaper` (unlimited unless a trace is given), so manifest and token
downloads pay the emulated link like the chunks do.

The client remembers, per context, the manifest and the token ids (in memory, and on disk under
``cache_dir`` when given): a device that asked about a context once can still answer questions
about it (computing everything locally) when the server is unreachable.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

from sparkv.edge.manifest import Manifest, ManifestError, tokens_digest
from sparkv.edge.shaper import LinkShaper
from sparkv.errors import SparkvError


class ServerUnavailable(SparkvError):
    """The server cannot be reached (connection refused, reset, timed out)."""


class ServerError(SparkvError):
    """The server answered with an error (``status``, ``code`` from its JSON error body)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"server error {status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


def error_from_response(status: int, body: bytes) -> ServerError:
    try:
        err = json.loads(body.decode("utf-8", "replace")).get("error", {})
        return ServerError(status, str(err.get("code", "http_error")),
                           str(err.get("message", "")))
    except (ValueError, AttributeError):
        return ServerError(status, "http_error", body[:200].decode("utf-8", "replace"))


@dataclass
class Fetched:
    """A body read through the shaper, with its timings (seconds)."""

    body: bytes
    seconds: float
    first_byte_s: float
    headers: dict[str, str]


class EdgeClient:
    """REST client of one sparkv server, and the entry point of the device side.

    Args:
        server_url: e.g. ``http://127.0.0.1:8080``.
        api_key: the tenant's key (``None`` for an anonymous loopback server).
        model: a :class:`~sparkv.runtime.model.LoadedModel`, a checkpoint path or name, or
            ``None`` for the bundled SmolLM2 (loaded on first use).
        shaper: link emulation for every byte read (default: unlimited).
        timeout_s: connect / read timeout of one request.
        cache_dir: where to keep manifests and token ids between runs (``None``: memory only).
    """

    def __init__(self, server_url: str, api_key: str | None = None, model: Any = None, *,
                 shaper: LinkShaper | None = None, timeout_s: float = 10.0,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.base_url = server_url.rstrip("/")
        self.api_key = api_key
        self._model_arg = model
        self._lm: Any = None
        self.shaper = shaper or LinkShaper.unlimited()
        self.timeout_s = float(timeout_s)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._http = httpx.Client(base_url=self.base_url,
                                  headers={**self.auth_headers(), "Accept-Encoding": "identity"},
                                  timeout=httpx.Timeout(self.timeout_s, connect=self.timeout_s))
        self._manifests: dict[str, Manifest] = {}
        self._tokens: dict[str, list[int]] = {}
        #: throughput (bytes/s) measured by the last streaming run: the next plan's prior
        self.bandwidth_estimate_Bps: float | None = None
        #: throughput of the last large JSON download (a probe for the first plan)
        self.last_probe_Bps: float | None = None
        #: round trip seen by the last request (time to its first body byte)
        self.rtt_estimate_s: float = 0.0
        #: measured / predicted compute time of layer steps on this device (learned per run)
        self.compute_scale: float = 1.0
        #: the last question prefill + first token (seconds): the next plan's suffix estimate
        self.question_prefill_s: float | None = None
        #: context id -> encryption key (base64url), for encrypted contexts
        self.encryption_keys: dict[str, str] = {}

    # ---- plumbing ----------------------------------------------------------------------------
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def lm(self) -> Any:
        """The device's model (loaded on first use)."""
        if self._lm is None:
            from sparkv.runtime.model import LoadedModel, load_model
            self._lm = (self._model_arg if isinstance(self._model_arg, LoadedModel)
                        else load_model(self._model_arg))
        return self._lm

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "EdgeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, shaped: bool = True,
                 headers: dict[str, str] | None = None, **kw: Any) -> Fetched:
        """One request, its body read through the shaper; raises ServerUnavailable or ServerError."""
        start = time.perf_counter()
        not_before = self.shaper.request_started() if shaped else None
        try:
            with self._http.stream(method, path, headers=headers, **kw) as r:
                parts: list[bytes] = []
                first = None
                for piece in r.iter_raw(65536):  # wire bytes: what the link carries
                    if shaped:
                        self.shaper.take(len(piece), not_before)
                    if first is None:
                        first = time.perf_counter() - start
                    parts.append(piece)
                body = b"".join(parts)
                wire = len(body)
                encoding = r.headers.get("content-encoding", "identity").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding not in ("identity", ""):
                    raise ServerError(r.status_code, "bad_encoding",
                                      f"unsupported Content-Encoding {encoding!r}")
                if r.status_code >= 400:
                    raise error_from_response(r.status_code, body)
                total = time.perf_counter() - start
                first = first if first is not None else total
                if shaped:
                    self.rtt_estimate_s = first
                    if wire >= (64 << 10) and total - first > 0:
                        self.last_probe_Bps = wire / (total - first)
                return Fetched(body, total, first, dict(r.headers))
        except (httpx.TransportError, OSError, EOFError) as e:
            raise ServerUnavailable(f"cannot reach the server at {self.base_url}: "
                                    f"{type(e).__name__}: {e}") from e

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        f = self._request(method, path, **kw)
        try:
            return json.loads(f.body)
        except ValueError as e:
            raise ServerError(200, "bad_json", f"{path} did not return JSON: {e}") from e

    # ---- REST --------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return self._json("GET", "/healthz", shaped=False)

    def create_context(self, *, text: str | None = None, token_ids: Sequence[int] | None = None,
                       levels: Sequence[str] | None = None, chunk_tokens: int | None = None,
                       heads_per_group: int = 0, model: str | None = None, wait: bool = True,
                       encrypt: bool = False, timeout_s: float = 900.0,
                       progress: bool = False) -> str:
        """Asks the server to encode a context; with ``wait``, polls its job until it is done.
        With ``encrypt`` the frames are stored AES-GCM-encrypted; the key the server returns
        (once) is kept in :attr:`encryption_keys`."""
        body: dict[str, Any] = {"heads_per_group": heads_per_group, "encrypt": bool(encrypt)}
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
        r = self._json("POST", "/v1/contexts", json=body, shaped=False)
        cid = str(r["context_id"])
        if r.get("encryption_key"):
            self.encryption_keys[cid] = str(r["encryption_key"])
        if token_ids is not None:
            self._tokens[cid] = [int(x) for x in token_ids]
        if not wait or r.get("status") == "done":
            return cid
        deadline = time.monotonic() + timeout_s
        last = -1.0
        while time.monotonic() < deadline:
            job = self._json("GET", f"/v1/jobs/{r['job_id']}", shaped=False)
            state = job.get("state")
            if state == "done":
                return cid
            if state in ("failed", "cancelled"):
                raise ServerError(500, f"job_{state}", str(job.get("error")))
            frac = float((job.get("progress") or {}).get("fraction", 0.0))
            if progress and frac - last >= 0.1:
                print(f"  encoding on the server: {job.get('phase')} {100 * frac:.0f}%", flush=True)
                last = frac
            time.sleep(0.2)
        raise ServerError(504, "job_timeout", f"context {cid} was not encoded in {timeout_s:.0f} s")

    def _cache_path(self, context_id: str) -> Path | None:
        if self.cache_dir is None:
            return None
        import hashlib
        host = hashlib.sha256(self.base_url.encode()).hexdigest()[:12]
        return self.cache_dir / host / context_id

    def manifest(self, context_id: str, *, use_cache: bool = True) -> Manifest:
        """The context's manifest (from memory or disk when ``use_cache``, else the server)."""
        if use_cache and context_id in self._manifests:
            return self._manifests[context_id]
        path = self._cache_path(context_id)
        if use_cache and path is not None and (path / "manifest.json").is_file():
            data = (path / "manifest.json").read_bytes()
            m = Manifest.parse(json.loads(data), len(data))
            self._manifests[context_id] = m
            return m
        f = self._request("GET", f"/v1/contexts/{context_id}",
                          headers={"Accept-Encoding": "gzip"})
        try:
            doc = json.loads(f.body)
        except ValueError as e:
            raise ManifestError(f"the manifest of {context_id} is not JSON: {e}") from e
        m = Manifest.parse(doc, len(f.body))
        if m.context_id != context_id:
            raise ManifestError(f"asked for {context_id}, the server sent {m.context_id}")
        self._manifests[context_id] = m
        if path is not None:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / "manifest.json.tmp"
            tmp.write_bytes(f.body)
            tmp.replace(path / "manifest.json")
        return m

    def tokens(self, context_id: str, *, use_cache: bool = True) -> list[int]:
        """The context's token ids (needed to compute chunks locally)."""
        if use_cache and context_id in self._tokens:
            return self._tokens[context_id]
        path = self._cache_path(context_id)
        if use_cache and path is not None and (path / "tokens.u32").is_file():
            ids = np.frombuffer((path / "tokens.u32").read_bytes(), dtype="<u4").tolist()
            self._tokens[context_id] = ids
            return ids
        f = self._request("GET", f"/v1/contexts/{context_id}/tokens")
        if len(f.body) % 4:
            raise ServerError(200, "bad_tokens", "the token body is not a whole number of u32")
        ids = np.frombuffer(f.body, dtype="<u4").tolist()
        want = f.headers.get("x-sparkv-tokens-sha256")
        if want and tokens_digest(ids) != want:
            raise ManifestError("the token ids do not match their digest")
        self._tokens[context_id] = ids
        if path is not None:
            path.mkdir(parents=True, exist_ok=True)
            (path / "tokens.u32").write_bytes(f.body)
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

    # ---- the main call -----------------------------------------------------------------------
    def ask(self, context_id: str, question: str, **options: Any) -> Any:
        """Answers ``question`` about a stored context; see :func:`sparkv.edge.ask.ask`."""
        from sparkv.edge.ask import ask
        return ask(self, context_id, question, **options)
