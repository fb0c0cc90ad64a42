"""Test-only helpers: a tiny random Llama checkpoint (with SmolLM2's tokenizer), a started tiny
server, and a stop that fails on a traceback in the server's log."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkv.server.process import ServerProcess, write_config

#: the environment of a server whose KV or answers a test compares with an in-process float32
#: reference bit for bit: float32 is the suite's default (tests/conftest.py), pinned here so that
#: a run with ``SPARKV_DTYPE=auto`` on a bf16 CPU leaves those comparisons meaningful
FLOAT32_SERVER = {"SPARKV_DTYPE": "float32"}

if TYPE_CHECKING:
    import httpx


def tiny_llama_model(layers: int = 3, name: str = "tiny-llama") -> Any:
    """A random Llama of ``layers`` layers (GQA: 4 query heads, 2 KV heads, hidden 64), fp32,
    seeded, loaded as sparkv loads a model (a :class:`~sparkv.runtime.LoadedModel`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparkv.runtime import LoadedModel

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=2048, rope_theta=10000.0, eos_token_id=None,
                      bos_token_id=None, pad_token_id=0)
    return LoadedModel.from_model(LlamaForCausalLM(cfg).to(torch.float32), None, name)


def tiny_checkpoint(path: str | os.PathLike[str], tokenizer_from: str | None = None,
                    layers: int = 2, seed: int = 0) -> Path:
    """Saves a small random Llama (GQA: 4 query heads, 2 KV heads, head_dim 16) to ``path``.

    With ``tokenizer_from`` (a checkpoint directory) its tokenizer is copied and the vocabulary
    sized to match, so the tiny model accepts text.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    vocab = 256
    tok = None
    if tokenizer_from:
        tok = AutoTokenizer.from_pretrained(tokenizer_from)
        vocab = len(tok)
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


_TINY: dict[str, Path] = {}


def shared_tiny_checkpoint() -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, built once per process in a temp dir."""
    if "path" not in _TINY:
        import atexit
        import tempfile

        from sparkv.runtime.model import default_checkpoint

        tmp = Path(tempfile.mkdtemp(prefix="sparkv-tiny-"))
        atexit.register(shutil.rmtree, tmp, True)
        _TINY["path"] = tiny_checkpoint(tmp / "tiny", tokenizer_from=str(default_checkpoint()))
    return _TINY["path"]



def start_tiny_server(tmp: Path, tenants: tuple[str, ...] = ("alice", "bob"),
                      **settings: Any) -> ServerProcess:
    """A started server on a file store under ``tmp`` with the tiny model (``"tiny"``, levels raw
    and q5, T = 32, 64 KiB bodies unless ``settings`` say otherwise) and one key per tenant.

    The process gets ``keys`` (tenant -> key), ``config_path`` and ``store_dir`` attributes.
    """
    config = {"models": {"tiny": str(shared_tiny_checkpoint())}, "default_model": "tiny",
              "default_levels": ["raw", "q5"], "default_chunk_tokens": 32,
              "max_body_bytes": 65536, **settings}
    keys = write_config(tmp / "server.yaml", list(tenants), **config)
    server = ServerProcess(tmp / "server.yaml", f"file://{tmp}/store",
                           log_path=tmp / "server.log").start()
    server.keys = keys  # type: ignore[attr-defined]
    server.config_path = tmp / "server.yaml"  # type: ignore[attr-defined]
    server.store_dir = tmp / "store"  # type: ignore[attr-defined]
    return server


def stop_checked(server: ServerProcess) -> None:
    """Stops ``server`` and fails if its log holds a traceback."""
    server.stop()
    log = server.log()
    assert "Traceback" not in log, log


# ---- REST test clients (shared by the server test modules) --------------------------------------
def api_client(server: ServerProcess, key: str | None, timeout: float = 60.0) -> "httpx.Client":
    """An httpx client for ``server`` sending ``key`` as a bearer token (none when ``None``)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=timeout)


def wait_job(c: "httpx.Client", job_id: str, timeout: float = 120.0, poll_s: float = 0.05) -> dict:
    """Polls ``/v1/jobs/{job_id}`` until the job leaves ``queued``/``running``."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = c.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        job = r.json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id} did not finish")


def create_context(c: "httpx.Client", **body: Any) -> dict:
    """``POST /v1/contexts`` and, when it was queued, waits for its job to finish (``done``)."""
    r = c.post("/v1/contexts", json=body)
    assert r.status_code in (200, 202), r.text
    out = r.json()
    if out["status"] != "done":
        job = wait_job(c, out["job_id"])
        assert job["state"] == "done", job
    return out


def assert_error(r: "httpx.Response", status: int, code: str | None = None) -> dict:
    """Asserts a JSON error body of ``status`` (and ``code`` when given) with a message."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["status"] == status and err["message"], err
    if code:
        assert err["code"] == code, err
    return err


def tenant_fixture(server_fixture: str, tenant: str, timeout: float = 60.0) -> Any:
    """A module-scoped fixture yielding a client of ``tenant`` on the server fixture named
    ``server_fixture``: ``alice = tenant_fixture("server", "alice")``."""
    import pytest

    @pytest.fixture(scope="module")
    def _client(request: Any) -> Any:
        srv = request.getfixturevalue(server_fixture)
        with api_client(srv, srv.keys[tenant], timeout) as c:
            yield c

    return _client


# ---- the device context service's tests ---------------------------------------------------------
def flash_profile(fast: bool = True) -> Any:
    """An I/O profile for the context service: ``fast`` reads cost nothing (the IO-recompute
    planner reads every chunk: exact restores); slow reads cost a lot (it recomputes what it may)."""
    from sparkv.device.flashio import IOProfile

    if fast:
        return IOProfile(read_Bps=1e13, per_file_s=0.0, threads=4, source="test")
    return IOProfile(read_Bps=1e3, per_file_s=1.0, threads=1, source="test")


#: a chat whose first turn plants a pass key that the last asks for
CHAT_TURNS = ["Remember the pass key 7191.", "What is the capital of France?",
              "Write one sentence about rivers.", "What was the pass key?"]


def raw_world(lm: Any, n_tokens: int, chunk_tokens: int, seed: int) -> dict[str, Any]:
    """A model's seeded random context of ``n_tokens``, its reference KV, its geometry and every
    chunk's raw frame (the engine tests' scripted source serves them)."""
    import torch

    from sparkv.codec import KVChunk, encode
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime.generate import reference_prefill
    from sparkv.runtime.kvcache import split_chunks

    torch.manual_seed(seed)
    tokens = torch.randint(0, 128, (n_tokens,)).tolist()
    with torch.inference_mode():
        ref = reference_prefill(lm, tokens)
    geo = ChunkGeometry.from_config(lm.config, n_tokens, chunk_tokens)
    frames = {}
    for cid, (k, v) in split_chunks(ref, geo).items():
        frames[(cid, "raw")] = encode(KVChunk(cid, geo.token_range(cid.t)[0], k.contiguous(),
                                              v.contiguous(), geo.num_layers), "raw")
    return {"lm": lm, "tokens": tokens, "ref": ref, "geo": geo, "frames": frames}


def same_payloads(a: dict, b: dict) -> None:
    """Asserts two snapshots ``{chunk id: (level, [tensors])}`` of a memory's payloads are equal,
    level and every tensor bit for bit."""
    import torch

    assert a.keys() == b.keys()
    for cid in a:
        assert a[cid][0] == b[cid][0], cid
        assert all(torch.equal(x, y) for x, y in zip(a[cid][1], b[cid][1])), cid


def self_signed_cert(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, written under ``tmp``:
    (cert file, key file)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class AloneLane:
    """A lane (sparkv.edge.lane.Lane) of an ask alone on a device service: the cores at once, no
    other ask's bytes ahead of it on the link."""

    def hold(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def run_step(self, stepper: Any, step: Any) -> Any:
        return stepper.run_step(step)

    def check(self) -> None:
        pass

    def load(self) -> float:
        return 1.0

    def first(self) -> bool:
        return True

    def attach(self, memory: Any) -> None:
        pass

    def link_turn(self, pending_bytes: float) -> Any:
        from sparkv.edge.lane import LinkTurn

        return LinkTurn(0.0, True)
