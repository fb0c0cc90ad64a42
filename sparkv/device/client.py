"""A client of the local context service (:mod:`sparkv.device.app`), over its Unix socket or a
loopback port, and a helper that runs ``sparkv device serve`` as a subprocess.

Over a port the client sends the service's bearer token, read from its token file
(:func:`sparkv.device.access.default_token_file` unless given): the caller needs nothing more
than the URL. An app token (``token=``, :mod:`sparkv.device.identity`) is sent on either
transport and makes the requests that app's. Every request names ``localhost`` as its Host (the
service answers no other).

:meth:`DeviceClient.ask` asks about a server context through the service (``POST /v1/asks``:
docs/device-service.md, "Asks"), its answer streamed token by token."""

from __future__ import annotations

import builtins
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import httpx

from sparkv.device.access import read_token
from sparkv.device.errors import (BudgetBusy, BudgetTooSmall, ContextBusy, ContextDamaged,
                                  DeviceError, FlashFull, NotOwner, PromptTooLong, QueueFull,
                                  ShuttingDown, UnknownContext)
from sparkv.device.schemas import CallReply, DoneEvent
from sparkv.launch import Proc, launch
from sparkv.protocol.errors import ApiError

_BY_STATUS = {403: NotOwner, 404: UnknownContext, 409: ContextBusy, 413: PromptTooLong,
              429: QueueFull, 503: BudgetBusy, 507: BudgetTooSmall}
_BY_CODE = {ContextDamaged.code: ContextDamaged, FlashFull.code: FlashFull,
            ShuttingDown.code: ShuttingDown}


def response_error(status: int, body: bytes) -> DeviceError:
    """The :class:`DeviceError` of an error response: the class of its status, with the
    ``message`` and ``code`` of its JSON error body (``{"error": {"status", "code", "message"}}``,
    read by :meth:`~sparkv.protocol.errors.ApiError.from_response`; a body that is not one gives
    the start of its text)."""
    err = ApiError.from_response(status, body)
    message = err.message or body[:200].decode("utf-8", "replace") or err.code
    cls = _BY_CODE.get(err.code) or _BY_STATUS.get(status, DeviceError)
    exc = cls(f"{message} (HTTP {status})")
    exc.status = status
    exc.code = err.code
    return exc


def event_error(event: dict[str, Any]) -> DeviceError:
    """The :class:`DeviceError` of an ask's ``error`` event (its status's class)."""
    err = event.get("error") or {}
    status = int(err.get("status", 500))
    exc = (_BY_CODE.get(str(err.get("code"))) or _BY_STATUS.get(status, DeviceError))(
        f"{err.get('message', 'the ask failed')} (HTTP {status})")
    exc.status, exc.code = status, str(err.get("code", "internal_error"))
    return exc


def default_socket() -> Path:
    """``$SPARKV_DEVICE_SOCKET``, else ``<sparkv cache>/device/sparkv-device.sock``."""
    env = os.environ.get("SPARKV_DEVICE_SOCKET")
    if env:
        return Path(env)
    from sparkv.runtime.model import cache_dir

    return cache_dir() / "device" / "sparkv-device.sock"


class DeviceClient:
    """REST client of ``sparkv device serve``.

    Args:
        socket: the service's Unix socket (default :func:`default_socket`), or
        url: ``http://127.0.0.1:PORT`` when it listens on loopback.
        token: the bearer token: an app token (either transport), or the service's own (``url``;
            default: the one in ``token_file``, default
            :func:`~sparkv.device.access.default_token_file`).
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, url: str | None = None,
                 timeout_s: float = 600.0, *, token: str | None = None,
                 token_file: str | os.PathLike[str] | None = None) -> None:
        if url:
            token = token or read_token(token_file)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if url:
            self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)
        else:
            path = str(socket or default_socket())
            self._http = httpx.Client(transport=httpx.HTTPTransport(uds=path),
                                      base_url="http://localhost", timeout=timeout_s,
                                      headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "DeviceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _req(self, method: str, path: str, **kw: Any) -> Any:
        r = self._http.request(method, path, **kw)
        if r.status_code >= 400:
            raise _refusal(r)
        return None if r.status_code == 204 else r.json()

    # ---- the API ---------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return self._req("GET", "/healthz")

    def new_context(self, system_prompt: str | None = None,
                    system_ids: Sequence[int] | None = None, label: str | None = None) -> str:
        body: dict[str, Any] = {} if label is None else {"label": label}
        if system_prompt is not None:
            body["system_prompt"] = system_prompt
        if system_ids is not None:
            body["system_ids"] = list(system_ids)
        return self._req("POST", "/v1/contexts", json=body)["id"]

    def call(self, ctx_id: str, prompt: str | None = None, max_new_tokens: int = 32, *,
             prompt_ids: Sequence[int] | None = None, grow: bool = True,
             timeout_s: float | None = None, **sampling: Any) -> CallReply:
        """``POST /v1/contexts/{id}/call``: the answer (``text``, ``tokens``, ``stats``: a
        :class:`~sparkv.generation.Generation`, as ``ContextService.call`` returns);
        ``sampling``: ``temperature``, ``top_p``, ``top_k``, ``seed`` (default: greedy)."""
        body: dict[str, Any] = {"max_new_tokens": max_new_tokens, "grow": grow,
                                **{k: v for k, v in sampling.items() if v is not None}}
        if prompt is not None:
            body["prompt"] = prompt
        if prompt_ids is not None:
            body["prompt_ids"] = list(prompt_ids)
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return CallReply.model_validate(self._req("POST", f"/v1/contexts/{ctx_id}/call",
                                                  json=body))

    def delete(self, ctx_id: str) -> None:
        self._req("DELETE", f"/v1/contexts/{ctx_id}")

    def list(self) -> list[dict[str, Any]]:
        return self._req("GET", "/v1/contexts")["contexts"]

    def damaged(self) -> builtins.list[dict[str, Any]]:
        """The contexts the service could not reopen (``{id, state, reason}``)."""
        return self._req("GET", "/v1/contexts").get("damaged", [])

    def describe(self, ctx_id: str) -> dict[str, Any]:
        return self._req("GET", f"/v1/contexts/{ctx_id}")

    def stats(self) -> dict[str, Any]:
        return self._req("GET", "/v1/stats")

    def share(self, ctx_id: str, apps: Sequence[str]) -> dict[str, Any]:
        """Shares a context of this app's with ``apps`` (``"*"``: every app; ``[]``: nobody)."""
        return self._req("PUT", f"/v1/contexts/{ctx_id}/share", json={"apps": list(apps)})

    # ---- asks ------------------------------------------------------------------------------------
    def ask_events(self, context_id: str, question: str, **fields: Any
                   ) -> Iterator[dict[str, Any]]:
        """``POST /v1/asks``: the ask's events as they arrive (``queued``, ``token`` ..., then
        ``done`` or ``error``). ``fields``: the body's (``server``, ``api_key``,
        ``max_new_tokens``, the ``AskOptions`` fields, ``share``); a refusal before the stream
        (429 ``queue_full``, ...) raises its :class:`DeviceError`. Closing the iterator early
        closes the connection, which cancels the ask."""
        body = {"context_id": context_id, "question": question,
                **{k: v for k, v in fields.items() if v is not None}}
        with self._http.stream("POST", "/v1/asks", json=body) as r:
            if r.status_code >= 400:
                r.read()
                raise _refusal(r)
            for line in r.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def ask(self, context_id: str, question: str, *,
            on_token: Callable[[dict[str, Any]], None] | None = None,
            **fields: Any) -> DoneEvent:
        """Asks and waits: the ``done`` event (``text``, ``tokens``, ``stats``: a
        :class:`~sparkv.generation.Generation`; ``kept_id``, ...); ``on_token`` gets each
        ``token`` event as it arrives. An ``error`` event raises its :class:`DeviceError`
        (``status``, ``code``)."""
        for event in self.ask_events(context_id, question, **fields):
            if event["type"] == "token" and on_token is not None:
                on_token(event)
            elif event["type"] == "done":
                return DoneEvent.model_validate(event)
            elif event["type"] == "error":
                raise event_error(event)
        raise DeviceError("the ask's stream ended without its done event")

    def ask_stats(self) -> dict[str, Any]:
        """``GET /v1/asks``: the asks running and waiting, the cores' load, the counts."""
        return self._req("GET", "/v1/asks")


def _refusal(r: httpx.Response) -> DeviceError:
    """The :class:`DeviceError` of an error response (``Retry-After`` read into
    ``retry_after_s`` for a 503 or a 429)."""
    exc = response_error(r.status_code, r.content)
    if isinstance(exc, (BudgetBusy, QueueFull)) and r.headers.get("retry-after", "").isdigit():
        exc.retry_after_s = int(r.headers["retry-after"])
    return exc


class DeviceProcess:
    """``python -m sparkv.cli device serve`` as a subprocess on a Unix socket, or on
    ``127.0.0.1:port`` with its token in ``token_file`` (default ``<swap_dir>/token``) (tests,
    benchmarks).

    ``kill()`` is a SIGKILL (a crash); ``stop()`` a SIGTERM then a wait.
    """

    def __init__(self, swap_dir: str | os.PathLike[str], budget_mb: float, *,
                 socket: str | os.PathLike[str] | None = None, model: str | None = None,
                 log_path: str | os.PathLike[str] | None = None,
                 extra_args: Sequence[str] = (), torch_threads: int = 1,
                 port: int | None = None,
                 token_file: str | os.PathLike[str] | None = None) -> None:
        self.swap_dir = Path(swap_dir)
        self.socket = Path(socket) if socket else self.swap_dir / "sparkv-device.sock"
        self.port = port
        self.token_file = Path(token_file) if token_file else self.swap_dir / "token"
        self.budget_mb = budget_mb
        self.model = model
        self.log_path = Path(log_path) if log_path else self.swap_dir / "serve.log"
        self.extra_args = list(extra_args)
        self.torch_threads = torch_threads
        self.proc: Proc | None = None
        self._log: Any = None

    def start(self, timeout: float = 180.0) -> "DeviceProcess":
        self.swap_dir.mkdir(parents=True, exist_ok=True)
        where = (["--port", str(self.port), "--token-file", str(self.token_file)]
                 if self.port else ["--socket", str(self.socket)])
        cmd = [sys.executable, "-m", "sparkv.cli", "device", "serve", "--flash-dir",
               str(self.swap_dir), "--memory-budget-mb", str(self.budget_mb), *where,
               "--threads", str(self.torch_threads), *self.extra_args]
        if self.model:
            cmd += ["--model", self.model]
        self._log = open(self.log_path, "ab")
        self.proc = launch(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, log=self._log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._close()
                raise DeviceError(f"sparkv device serve exited ({self.proc.returncode}):\n"
                                  f"{self.log()[-3000:]}")
            if self.token_file.exists() if self.port else self.socket.exists():
                try:
                    with self.client(timeout_s=5) as c:
                        c.health()
                    return self
                except (httpx.HTTPError, DeviceError):
                    pass
            time.sleep(0.2)
        self.stop()
        raise DeviceError(f"sparkv device serve did not answer in {timeout:.0f} s:\n"
                          f"{self.log()[-3000:]}")

    @property
    def url(self) -> str | None:
        """``http://127.0.0.1:PORT`` when it listens on a port."""
        return f"http://127.0.0.1:{self.port}" if self.port else None

    def client(self, timeout_s: float = 600.0, app: str | None = None) -> DeviceClient:
        """A client of this service (over its port: with the token of its token file); with
        ``app``, that app's (its app token: :meth:`app_token`)."""
        token = self.app_token(app) if app is not None else None
        if self.port:
            return DeviceClient(url=self.url, timeout_s=timeout_s, token=token,
                                token_file=self.token_file)
        return DeviceClient(self.socket, timeout_s=timeout_s, token=token)

    def app_token(self, name: str) -> str:
        """App ``name``'s token for this service (from the app key in its flash dir)."""
        from sparkv.device.identity import app_key, app_token

        return app_token(app_key(self.swap_dir), name)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the process dies as in a crash (no cleanup)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close()

    def _close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "DeviceProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
