"""CLI commands of the server: ``sparkv serve``, ``sparkv worker``, ``sparkv encode`` and
``sparkv apikey``.

Every ``serve`` option also reads an environment variable (:data:`SERVE_ENV`), which is how
docker-compose.yml configures the container; the command line wins over the environment, which
wins over the config file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from sparkv.cliflags import PRESS_METAVAR, context_name
from sparkv.logs import STAMPED, setup_logging

log = logging.getLogger("sparkv.server")

LOOPBACK = ("127.0.0.1", "localhost", "::1")

SERVE_ENV: dict[str, str] = {
    "--host": "SPARKV_HOST",
    "--device": "SPARKV_DEVICE",
    "--dtype": "SPARKV_DTYPE",
    "--port": "SPARKV_PORT",
    "--store": "SPARKV_STORE",
    "--config": "SPARKV_CONFIG",
    "--ssl-certfile": "SPARKV_SSL_CERTFILE",
    "--ssl-keyfile": "SPARKV_SSL_KEYFILE",
    "--ssl-keyfile-password": "SPARKV_SSL_KEYFILE_PASSWORD",
    "--ssl-ca-certs": "SPARKV_SSL_CA_CERTS",
    "--ssl-require-client-cert": "SPARKV_SSL_REQUIRE_CLIENT_CERT",
    "--threads": "SPARKV_TORCH_THREADS",
    "--log-level": "SPARKV_LOG_LEVEL",
    "--job-queue": "SPARKV_JOB_QUEUE",
}
"""``serve`` option -> the environment variable that sets its default."""


def _env(option: str, default: Any = None) -> Any:
    return os.environ.get(SERVE_ENV[option], default)


def register(sub: "argparse._SubParsersAction") -> None:
    """Adds the server's commands (``serve``, ``encode``, ``worker``, ``apikey``) to the CLI."""
    _add_serve(sub)
    _add_encode(sub)
    _add_worker(sub)
    k = sub.add_parser("apikey", help="make a new API key and its hash for the config file")
    k.add_argument("--tenant", default="my-tenant",
                   help="the tenant the key belongs to (names its config lines)")
    k.add_argument("--config", default=None,
                   help="write a new server config FILE holding the tenant and its key's hash, "
                        "and print only the key (an existing FILE is refused: add the lines to "
                        "it yourself)")
    k.set_defaults(func=apikey)


def _add_serve(sub: "argparse._SubParsersAction") -> None:
    s = sub.add_parser("serve", help="run the REST server (uvicorn)",
                       description="Run the sparkv REST server. Each option's default comes from "
                                   "the environment variable in brackets.")
    s.add_argument("--host", default=_env("--host", "127.0.0.1"), help="[SPARKV_HOST] bind "
                   "address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=int(_env("--port", 8080)),
                   help="[SPARKV_PORT] (default 8080)")
    s.add_argument("--store", default=_env("--store"),
                   help="[SPARKV_STORE] file:///path or redis://host:port/db (default: the "
                        "config file's, else file://./sparkv-store)")
    s.add_argument("--config", default=_env("--config"), help="[SPARKV_CONFIG] YAML config file "
                   "(tenants, models, limits; see deploy/server-config.example.yaml)")
    s.add_argument("--ssl-certfile", default=_env("--ssl-certfile"),
                   help="[SPARKV_SSL_CERTFILE] PEM certificate: serve HTTPS")
    s.add_argument("--ssl-keyfile", default=_env("--ssl-keyfile"),
                   help="[SPARKV_SSL_KEYFILE] PEM private key of the certificate")
    s.add_argument("--ssl-keyfile-password", default=_env("--ssl-keyfile-password"),
                   help="[SPARKV_SSL_KEYFILE_PASSWORD] password of the key file (default: none)")
    s.add_argument("--ssl-ca-certs", default=_env("--ssl-ca-certs"),
                   help="[SPARKV_SSL_CA_CERTS] CA bundle that client certificates must chain to")
    s.add_argument("--ssl-require-client-cert", action="store_true",
                   default=_env("--ssl-require-client-cert", "") in ("1", "true", "yes"),
                   help="[SPARKV_SSL_REQUIRE_CLIENT_CERT=1] mutual TLS: refuse clients without "
                        "a certificate from --ssl-ca-certs")
    s.add_argument("--threads", type=int, default=_int_or_none(_env("--threads")),
                   help="[SPARKV_TORCH_THREADS] PyTorch threads for prefill (default: config, "
                        "else all cores)")
    s.add_argument("--device", default=_env("--device"),
                   help="[SPARKV_DEVICE] where models prefill: cpu, cuda[:N] or auto (default: "
                        "config, else auto)")
    s.add_argument("--dtype", default=_env("--dtype"),
                   help="[SPARKV_DTYPE] auto (bf16 on a GPU; bf16 on a CPU with AVX512-BF16/AMX "
                        "where the model's quality table passes it, else fp32), float32, "
                        "bfloat16, float16 (default: config, else auto)")
    s.add_argument("--log-level", default=_env("--log-level", "info"),
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="[SPARKV_LOG_LEVEL]")
    s.add_argument("--job-queue", default=_env("--job-queue"),
                   help="[SPARKV_JOB_QUEUE] local (encode in this process), redis (the store's "
                        "Redis, run by `sparkv worker`) or a redis:// URL (default: config, else "
                        "local; docs/cluster.md)")
    s.add_argument("--access-log", action="store_true", help="log every request")
    s.add_argument("--allow-anonymous", action="store_true",
                   help="accept requests without an API key as tenant 'anonymous'")
    s.set_defaults(func=serve)


def _add_encode(sub: "argparse._SubParsersAction") -> None:
    e = sub.add_parser("encode", help="pre-encode a context offline into a store",
                       description="Encode a text file's context into a store with the server's "
                                   "own encoder (same ids, same manifest).")
    e.add_argument("file", help="text file (or, with --token-ids, a JSON list of token ids); "
                               "'-' reads stdin")
    e.add_argument("--store", default=os.environ.get("SPARKV_STORE"),
                   help="store URL (default: $SPARKV_STORE, the config's, else "
                        "file://./sparkv-store)")
    e.add_argument("--config", default=os.environ.get("SPARKV_CONFIG"),
                   help="server config file (models, defaults)")
    e.add_argument("--tenant", default=None,
                   help="tenant that owns the context (default: the config's only tenant, "
                        "else 'anonymous')")
    e.add_argument("--model", default=None, help="model name from the config (default: its "
                   "default model)")
    e.add_argument("--levels", default=None, help="comma-separated levels (default: config)")
    e.add_argument("--chunk-tokens", type=int, default=None, help="T (default: config)")
    e.add_argument("--heads-per-group", type=int, default=0,
                   help="KV heads per group; must divide the model's KV heads (0: all in one)")
    e.add_argument("--token-ids", action="store_true", help="FILE holds a JSON list of token ids")
    e.add_argument("--name", type=context_name, default=None,
                   help="a label for the context (listed by `sparkv context list`; not part of "
                        "its id)")
    e.add_argument("--press", default=None, metavar=PRESS_METAVAR,
                   help="compress with a KV press first, question-agnostically (adakv:0.5; "
                        "docs/presses.md): only the kept entries are stored")
    e.add_argument("--encrypt", action="store_true",
                   help="encrypt frames; prints the key once (it is stored nowhere)")
    e.add_argument("--threads", type=int, default=None,
                   help="PyTorch threads for prefill (default: config, else all cores)")
    e.add_argument("--encode-threads", type=int, default=None, metavar="N",
                   help="threads coding the frames (0: auto, the cores up to 8; default: config's "
                        "encode_threads)")
    e.add_argument("--device", default=None, help="cpu, cuda[:N] or auto (default: config)")
    e.add_argument("--dtype", default=None, help="auto, float32, bfloat16 (default: config)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=encode)


def _add_worker(sub: "argparse._SubParsersAction") -> None:
    w = sub.add_parser("worker", help="run an encode worker of a cluster (docs/cluster.md)",
                       description="Take encode jobs from the shared Redis queue and run them "
                                   "(job_queue: redis). Each option's default comes from the "
                                   "environment variable in brackets.")
    w.add_argument("--store", default=_env("--store"), help="[SPARKV_STORE] redis://host:port/db")
    w.add_argument("--config", default=_env("--config"), help="[SPARKV_CONFIG] config file")
    w.add_argument("--job-queue", default=_env("--job-queue"),
                   help="[SPARKV_JOB_QUEUE] redis (the store's Redis, the default here) or a "
                        "redis:// URL")
    w.add_argument("--name", default=os.environ.get("SPARKV_WORKER_NAME"),
                   help="[SPARKV_WORKER_NAME] consumer name (default: host-pid-random)")
    w.add_argument("--threads", type=int, default=_int_or_none(_env("--threads")),
                   help="[SPARKV_TORCH_THREADS] PyTorch threads for prefill")
    w.add_argument("--device", default=_env("--device"), help="[SPARKV_DEVICE] cpu, cuda[:N], auto")
    w.add_argument("--dtype", default=_env("--dtype"), help="[SPARKV_DTYPE]")
    w.add_argument("--max-jobs", type=int, default=None, help="exit after this many jobs")
    w.add_argument("--log-level", default=_env("--log-level", "info"),
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="[SPARKV_LOG_LEVEL]")
    w.set_defaults(func=worker)


def _int_or_none(value: Any) -> int | None:
    return None if value in (None, "") else int(value)


def _check_device(settings: Any) -> None:
    """Fails at startup (not at the first encode) on a device or dtype this machine lacks."""
    from sparkv.runtime.compute import resolve_dtype
    from sparkv.runtime.device import DeviceUnavailable, resolve_device
    from sparkv.server.errors import ConfigError

    try:
        resolve_dtype(settings.dtype, resolve_device(settings.device))
    except DeviceUnavailable as exc:
        raise ConfigError(str(exc)) from None


def _settings(config: str | None, store: str | None, **extra: Any) -> Any:
    from sparkv.server.config import load_settings

    return load_settings(config, store=store, **extra)


def _log_level(args: argparse.Namespace, configured: str) -> str:
    """``--log-level`` (or the config's), unless ``sparkv -v``/``-q`` asked otherwise."""
    verbosity = getattr(args, "verbosity", 0)
    return configured if not verbosity else "debug" if verbosity > 0 else "warning"


# ------------------------------------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    from sparkv.extras import SERVER_MODULES, require_all
    from sparkv.server.errors import ConfigError

    require_all(SERVER_MODULES, feature="sparkv serve")
    settings = _settings(args.config, args.store, torch_threads=args.threads,
                         log_level=args.log_level,
                         allow_anonymous=True if args.allow_anonymous else None,
                         device=args.device, dtype=args.dtype, job_queue=args.job_queue)
    settings.log_level = _log_level(args, settings.log_level)
    setup_logging(level=settings.log_level, fmt=STAMPED)
    if not settings.tenants and not settings.allow_anonymous:
        if args.host not in LOOPBACK:
            raise ConfigError("no tenants are configured: add API key hashes to the config file "
                              "(`sparkv apikey` makes one) or pass --allow-anonymous")
        settings.allow_anonymous = True
        log.warning("sparkv serve: no tenants configured; accepting requests without a key as "
                    "tenant 'anonymous' (loopback only)")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise ConfigError("TLS needs both --ssl-certfile and --ssl-keyfile")
    if args.ssl_require_client_cert and not (args.ssl_certfile and args.ssl_ca_certs):
        raise ConfigError("--ssl-require-client-cert needs --ssl-certfile, --ssl-keyfile and "
                          "--ssl-ca-certs")
    from sparkv.launch import exit_with_parent
    from sparkv.rest.listen import bind_tcp, serve as serve_app

    sockets = bind_tcp(args.host, args.port)  # a port in use is one line before anything loads
    exit_with_parent()      # started by a benchmark or the demo: ends with it
    import ssl
    import torch

    _check_device(settings)
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    from sparkv.server.app import create_app

    app = create_app(settings)
    scheme = "https" if args.ssl_certfile else "http"
    log.info("sparkv serve: %s://%s:%s store=%s tenants=%d models=%s", scheme, args.host,
             args.port, app.state.sparkv.store.url, len(settings.tenants),
             ",".join(settings.models))
    serve_app(app, sockets, header_timeout_s=settings.header_timeout_s,
              log_level=settings.log_level, access_log=args.access_log,
              ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
              ssl_keyfile_password=args.ssl_keyfile_password, ssl_ca_certs=args.ssl_ca_certs,
              ssl_cert_reqs=ssl.CERT_REQUIRED if args.ssl_require_client_cert else ssl.CERT_NONE,
              timeout_keep_alive=30, server_header=False)
    return 0


# ------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    from sparkv.extras import SERVER_MODULES, require_all
    from sparkv.server.errors import ConfigError

    require_all(SERVER_MODULES + ("redis",), feature="sparkv worker")
    from sparkv.server.models import ModelRegistry
    from sparkv.server.stores import open_store
    from sparkv.server.worker import EncodeWorker, install_signal_handlers

    common = dict(torch_threads=args.threads, log_level=args.log_level,
                  device=args.device, dtype=args.dtype)
    settings = _settings(args.config, args.store, job_queue=args.job_queue, **common)
    if settings.job_queue == "local":  # a worker always uses a shared queue: the store's Redis
        settings = _settings(args.config, args.store, job_queue="redis", **common)
    if args.max_jobs is not None and args.max_jobs < 1:
        raise ConfigError("--max-jobs must be at least 1")
    _check_device(settings)
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    setup_logging(level=_log_level(args, settings.log_level), fmt=STAMPED)
    store = open_store(settings.store)
    registry = ModelRegistry(settings.models, settings.max_context_tokens, settings.device,
                             settings.dtype)
    w = EncodeWorker(settings, store, registry, name=args.name)
    install_signal_handlers(w)
    log.info("sparkv worker %s: queue=%s store=%s", w.name, w.queue.url, store.url)
    w.run(max_jobs=args.max_jobs)
    store.close()
    return 0


# ------------------------------------------------------------------------------------------------
def encode(args: argparse.Namespace) -> int:
    """``sparkv encode``: encodes a file's context into a store (nothing when it is there)."""
    from sparkv.protocol.crypto import key_to_text, new_key
    from sparkv.server.encoder import backfill_tokens, derive_context_id
    from sparkv.server.ordered_pool import auto_threads
    from sparkv.server.stores import open_store

    settings = _encode_settings(args)
    tenant = _encode_tenant(args.tenant, settings)
    text = sys.stdin.read() if args.file == "-" else _read_text(args.file)
    entry, ids = _token_ids(args, settings, text)
    spec = _context_spec(args, settings, tenant, entry, ids)
    cid = derive_context_id(spec, entry.fingerprint, entry.tokenizer_id)
    store = open_store(settings.store)
    result: dict[str, Any] = {"context_id": cid, "tenant": tenant, "store": store.url,
                              "num_tokens": len(ids), "levels": list(spec.levels)}
    if store.manifests.get(tenant, cid) is not None:
        # encoded before token ids were kept: add them (GET .../tokens serves them)
        added = backfill_tokens(store.chunks, spec, cid)
        result.update(status="exists", tokens_added=added)
        _report(args, result, f"context {cid} is already in {store.url} ("
                f"{'its token ids were added' if added else 'nothing to do'})")
        return 0
    key = new_key() if args.encrypt else None
    manifest, stats = _encode_and_publish(store, entry, spec, cid, key,
                                          auto_threads(settings.encode_threads))
    result.update(status="encoded", frames=stats.frames_encoded + stats.frames_reused,
                  prefill_s=round(stats.prefill_s, 3), codec_s=round(stats.codec_s, 3),
                  store_s=round(stats.store_s, 3), total_s=round(stats.total_s, 3),
                  manifest_bytes=len(manifest))
    if key:
        result["encryption_key"] = key_to_text(key)
    msg = (f"context {cid}: {len(ids)} tokens, {result['frames']} frames at "
           f"{','.join(spec.levels)} in {stats.total_s:.1f} s -> {store.url} (tenant {tenant})")
    if key:
        msg += f"\nencryption key (shown once, stored nowhere): {result['encryption_key']}"
    _report(args, result, msg)
    return 0


def _encode_tenant(asked: str | None, settings: Any) -> str:
    """The tenant ``sparkv encode`` stores under: ``--tenant``, else the config's only tenant,
    else ``anonymous``. A tenant the server could not map a request to (not in the config, or
    ``anonymous`` while the config has tenants and no ``allow_anonymous``) is a
    :class:`ConfigError`: its contexts would be reachable by no key."""
    from sparkv.server.config import ANONYMOUS_TENANT
    from sparkv.server.errors import ConfigError

    reachable = set(settings.tenants)
    if settings.allow_anonymous or not settings.tenants:
        reachable.add(ANONYMOUS_TENANT)
    tenant = asked or (next(iter(settings.tenants)) if len(settings.tenants) == 1
                       else ANONYMOUS_TENANT)
    if tenant not in reachable:
        raise ConfigError(f"tenant {tenant!r} is not in the config, so no API key reaches its "
                          f"contexts: use one of {', '.join(sorted(reachable))} "
                          "(--tenant), or add it (`sparkv apikey --tenant NAME` prints its "
                          "lines)")
    return tenant


def _encode_settings(args: argparse.Namespace) -> Any:
    """The settings of ``sparkv encode`` (its options over the config), the device checked and
    PyTorch's threads set."""
    settings = _settings(args.config, args.store, torch_threads=args.threads,
                         device=args.device, dtype=args.dtype,
                         encode_threads=args.encode_threads)
    _check_device(settings)
    if args.threads or settings.torch_threads:
        import torch

        torch.set_num_threads(args.threads or settings.torch_threads)
    return settings


def _token_ids(args: argparse.Namespace, settings: Any, text: str) -> tuple[Any, list[int]]:
    """The model's entry and the context's token ids: ``text`` tokenized, or read as a JSON
    list with ``--token-ids``. Raises :class:`ConfigError` for no tokens, too many, or ids
    outside the vocabulary."""
    from sparkv.server.errors import ApiError, ConfigError
    from sparkv.server.models import ModelRegistry

    registry = ModelRegistry(settings.models, settings.max_context_tokens,
                             settings.device, settings.dtype)
    try:
        entry = registry.get(args.model or settings.default_model)
        if args.token_ids:
            try:
                ids = [int(x) for x in json.loads(text)]
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{args.file}: not a JSON list of token ids ({exc})") from None
            bad = [x for x in ids if not 0 <= x < entry.vocab_size]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside [0, {entry.vocab_size})")
        else:
            if entry.lm.tokenizer is None:
                raise ConfigError(f"model {entry.name!r} has no tokenizer: use --token-ids")
            ids = entry.lm.encode_text(text)
    except ApiError as exc:
        raise ConfigError(exc.message) from None
    if not ids:
        raise ConfigError(f"{args.file} holds no tokens")
    if len(ids) > entry.max_tokens:
        raise ConfigError(f"{len(ids)} tokens; {entry.name!r} accepts at most {entry.max_tokens}")
    return entry, ids


def _context_spec(args: argparse.Namespace, settings: Any, tenant: str, entry: Any,
                  ids: list[int]) -> Any:
    """The :class:`~sparkv.server.encoder.ContextSpec` the options ask for (levels and chunk
    size default to the config's). Raises :class:`ConfigError` for unknown levels or presses."""
    from sparkv.server.encoder import ContextSpec, canonical_levels
    from sparkv.server.errors import ConfigError

    try:
        levels = canonical_levels(args.levels.split(",") if args.levels
                                  else settings.default_levels)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    press = None
    if getattr(args, "press", None):
        from sparkv.presses import PressError, canonical_spec

        try:
            press = canonical_spec(args.press)
        except PressError as exc:
            raise ConfigError(f"--press: {exc}") from None
    spec = ContextSpec(tenant, entry.name, tuple(ids), args.chunk_tokens or
                       settings.default_chunk_tokens, levels, args.heads_per_group, args.encrypt,
                       press, args.name)
    _check_frame_cap(settings, entry, spec)
    return spec


def _check_frame_cap(settings: Any, entry: Any, spec: Any) -> None:
    """Refuses (:class:`ConfigError`) a spec whose frames would exceed the config's
    ``max_frame_bytes``, as ``POST /v1/contexts`` does, or whose geometry is invalid."""
    from sparkv.layout import ChunkGeometry
    from sparkv.server.encoder import frame_cap_error
    from sparkv.server.errors import ConfigError

    try:
        geometry = ChunkGeometry.from_config(entry.lm.config, spec.num_tokens, spec.chunk_tokens,
                                             spec.heads_per_group)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    too_large = frame_cap_error(geometry, entry.lm.dtype.itemsize, spec.encrypted,
                                settings.max_frame_bytes)
    if too_large is not None:
        raise ConfigError(f"{too_large[0]} (max_frame_bytes in the config)")


def _encode_and_publish(store: Any, entry: Any, spec: Any, cid: str, key: bytes | None,
                        threads: int = 1) -> tuple[bytes, Any]:
    """Encodes the context on ``threads`` threads (a progress bar on stderr; frames encrypted
    with ``key``) and publishes its manifest; on any failure removes what was stored.
    ``(manifest, stats)``."""
    from sparkv.logs import phase_progress, progress_bar

    from sparkv.protocol.crypto import FrameCipher
    from sparkv.server.encoder import encode_context

    cipher = FrameCipher(key, cid) if key else None
    bar = progress_bar(total=None, unit="frame", desc="prefill", file=sys.stderr)
    progress = phase_progress(bar)
    try:
        manifest, stats = encode_context(entry, spec, cid, store.chunks, cipher=cipher,
                                         progress=progress, reuse_stored=not spec.encrypted,
                                         threads=threads)
        store.manifests.put(spec.tenant, cid, manifest)
    except BaseException:
        bar.close()
        if store.manifests.get(spec.tenant, cid) is None:
            store.delete_context(spec.tenant, cid)  # no half-encoded leftovers
        raise
    bar.close()
    return manifest, stats


def _write_new_config(path: Path, lines: str) -> None:
    """Creates ``path`` holding ``lines`` (a server config); refuses an existing file."""
    from sparkv.server.errors import ConfigError

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise ConfigError(f"{path} exists: run `sparkv apikey --tenant NAME` without --config "
                          "and add the lines it prints under tenants: yourself") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("# a sparkv server config written by `sparkv apikey` (docs/server.md, "
                "\"Configuration file\")\n" + lines)


def _read_text(path: str) -> str:
    from sparkv.server.errors import ConfigError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def _report(args: argparse.Namespace, result: dict[str, Any], message: str) -> None:
    print(json.dumps(result, indent=2) if args.json else message)


def apikey(args: argparse.Namespace) -> int:
    from sparkv.server.config import TENANT_NAME, hash_api_key, new_api_key
    from sparkv.server.errors import ConfigError

    if not TENANT_NAME.match(args.tenant):
        raise ConfigError(f"tenant name must match {TENANT_NAME.pattern}")
    key = new_api_key()
    lines = f"tenants:\n  {args.tenant}:\n    keys:\n      - {hash_api_key(key)}\n"
    if args.config:
        _write_new_config(Path(args.config), lines)
        log.info("wrote %s: tenant %s and the hash of its key (the key is printed, not "
                 "stored)", args.config, args.tenant)
        print(key)
        return 0
    print(f"API key (give it to the client; it is not stored): {key}")
    print("config file lines:")
    print(f"tenants:\n  {args.tenant}:\n    keys:\n      - {hash_api_key(key)}")
    return 0
