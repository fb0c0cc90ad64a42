#!/usr/bin/env bash
# The sparkv server in containers (docs/server.md, "Containers"): the images built, the cluster
# topology of docs/cluster.md started (Redis, N API replicas, M encode workers, nginx in front),
# tested from the host, and removed again.
#
#   bash deploy/container.sh build     # base images (if needed), then redis, nginx and server images
#   bash deploy/container.sh up        # start the topology, wait until every part is healthy
#   bash deploy/container.sh test      # build + up + an edge ask from the host + one API container
#                                      # killed under load; writes bench/results/container.json; down
#   bash deploy/container.sh down      # remove every container this script started (images stay)
#   bash deploy/container.sh --dry-run test   # print every command instead of running it
#
# The engine is podman (preferred) or docker. Without a registry (this kind of machine) the base
# images come from Debian's packages: mmdebstrap makes a bookworm root (python3; redis-server;
# nginx-light), cached as tar files, and the engine imports them. pip in the server build trusts
# the CA bundle and uses the find-links folder and file:// indexes that `pip config list` names
# on the host, mounted read-only into the build (podman build -v). Every container uses the
# host's network (--network=host): all ports are on 127.0.0.1.
#
# Settings (environment):
#   SPARKV_ENGINE         podman or docker (default: podman if installed)
#   SPARKV_BASE           local (mmdebstrap; default when mmdebstrap is installed) or registry
#   SPARKV_IMAGE_CACHE    where mmdebstrap's tars are kept (default /var/cache/sparkv-images)
#   SPARKV_EXTRAS         the project's extras in the server image (default server)
#   SPARKV_API_REPLICAS   API containers (default 2)     SPARKV_WORKERS   worker containers (default 2)
#   SPARKV_CT_PORT        nginx's port (default 18080)   SPARKV_CT_API_PORT  first replica's (18090)
#   SPARKV_CT_REDIS_PORT  Redis's port (default 16379)
#   SPARKV_CT_DIR         state: config, key, rendered nginx.conf, logs (default ./sparkv-container)
#   SPARKV_CT_JSON        the test's summary (default bench/results/container.json)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
NAME=sparkv-ct
LABEL=sparkv.deploy=$NAME
CACHE=${SPARKV_IMAGE_CACHE:-/var/cache/sparkv-images}
EXTRAS=${SPARKV_EXTRAS-server}
API=${SPARKV_API_REPLICAS:-2}
WORKERS=${SPARKV_WORKERS:-2}
PORT=${SPARKV_CT_PORT:-18080}
API_PORT=${SPARKV_CT_API_PORT:-18090}
REDIS_PORT=${SPARKV_CT_REDIS_PORT:-16379}
DIR=${SPARKV_CT_DIR:-$ROOT/sparkv-container}
JSON=${SPARKV_CT_JSON:-$ROOT/bench/results/container.json}
PY=${PYTHON:-$ROOT/.venv/bin/python}
SERVER_IMAGE=localhost/sparkv-server:latest
REDIS_IMAGE=localhost/sparkv-redis:latest
NGINX_IMAGE=localhost/sparkv-nginx:latest
SUITE=bookworm

say() { echo "container: $*"; }
die() { echo "container: $*" >&2; exit 1; }
run() {  # prints a command (shell-quoted); runs it unless --dry-run
  echo "+$(printf ' %q' "$@")"
  [ "$DRY_RUN" = 1 ] || "$@"
}
now() { date +%s.%N; }
short() { local n=${1##*/}; echo "${n%%:*}"; }  # localhost/sparkv-redis:latest -> sparkv-redis
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
fact() { [ "$DRY_RUN" = 1 ] || echo "$1=$2" >>"$DIR/facts.txt"; }  # KEY VALUE for the summary
run_logged() {  # LOG COMMAND...: like run, the command's output into LOG (its tail on failure)
  local log=$1
  shift
  echo "+$(printf ' %q' "$@") >$log"
  [ "$DRY_RUN" = 1 ] && return 0
  mkdir -p "$(dirname "$log")"
  "$@" >"$log" 2>&1 || { tail -30 "$log" >&2; die "failed: $1 ... (the whole output: $log)"; }
}

pick_engine() {
  ENGINE=${SPARKV_ENGINE:-}
  if [ -z "$ENGINE" ]; then
    if command -v podman >/dev/null; then ENGINE=podman
    elif command -v docker >/dev/null; then ENGINE=docker
    elif [ "$DRY_RUN" = 1 ]; then ENGINE=podman
    else die "neither podman nor docker is installed (apt-get install podman runc)"; fi
  fi
  ENG=("$ENGINE")
  # Debian's podman: crun refuses this kernel's hybrid cgroups; runc works.
  if [ "$ENGINE" = podman ] && command -v runc >/dev/null; then ENG+=(--runtime runc); fi
  BASE_MODE=${SPARKV_BASE:-}
  if [ -z "$BASE_MODE" ]; then
    if command -v mmdebstrap >/dev/null || [ "$DRY_RUN" = 1 ]; then BASE_MODE=local
    else BASE_MODE=registry; fi
  fi
}

podman_conf() {  # podman's default ulimits are refused here (setrlimit: Operation not permitted)
  local conf=/etc/containers/containers.conf
  [ "$ENGINE" = podman ] && [ "$(id -u)" = 0 ] || return 0
  if ! grep -qs '^default_ulimits' "$conf"; then
    say "writing default_ulimits = [] into $conf"
    if [ "$DRY_RUN" = 0 ]; then
      mkdir -p /etc/containers
      if grep -qs '^\[containers\]' "$conf"; then
        sed -i 's/^\[containers\]/[containers]\ndefault_ulimits = []/' "$conf"
      else
        printf '[containers]\ndefault_ulimits = []\n' >>"$conf"
      fi
    fi
  fi
}

have_image() { [ "$DRY_RUN" = 0 ] && "${ENG[@]}" image inspect "$1" >/dev/null 2>&1; }

debian_base() {  # IMAGE PACKAGES: a bookworm root with PACKAGES, made once and cached as a tar
  local image=$1 packages=$2 tar
  tar=$CACHE/$(echo "${image#localhost/}" | tr ':/' '--').tar
  if have_image "$image"; then return 0; fi
  if [ ! -s "$tar" ]; then
    command -v mmdebstrap >/dev/null || [ "$DRY_RUN" = 1 ] ||
      die "mmdebstrap is not installed (apt-get install mmdebstrap), or set SPARKV_BASE=registry"
    run mkdir -p "$CACHE"
    run_logged "$DIR/logs/mmdebstrap-$(short "$image").log" \
      nice -n 10 mmdebstrap --format=tar --variant=minbase --include="$packages" "$SUITE" "$tar.part"
    run mv "$tar.part" "$tar"
  fi
  run_logged "$DIR/logs/import-$(short "$image").log" "${ENG[@]}" import "$tar" "$image"
}

pip_build_args() {  # fills PIP_ARGS: mounts and build args from the host's pip config
  PIP_ARGS=()
  # only podman mounts folders into a build (docker build has no -v): docker needs a registry
  [ "$BASE_MODE" = local ] && [ "$ENGINE" = podman ] || return 0
  local cert links extra path url
  cert=$(pip_conf cert)
  links=$(pip_conf find-links)
  extra=$(pip_conf extra-index-url)
  if [ -n "$cert" ]; then
    PIP_ARGS+=(-v "$cert:/etc/sparkv-build/ca.crt:ro" --build-arg CA_CERT=/etc/sparkv-build/ca.crt)
  fi
  for path in $links; do PIP_ARGS+=(-v "$path:$path:ro"); done
  [ -z "$links" ] || PIP_ARGS+=(--build-arg "FIND_LINKS=$links")
  local kept=()
  for url in $extra; do
    case "$url" in
      file://*) path=${url#file://}; path=${path%/simple}; PIP_ARGS+=(-v "$path:$path:ro"); kept+=("$url") ;;
      *) kept+=("$url") ;;
    esac
  done
  [ ${#kept[@]} = 0 ] || PIP_ARGS+=(--build-arg "EXTRA_INDEX_URL=${kept[*]}")
  # the CPU torch wheel lies in FIND_LINKS: the default index and that folder, as setup.sh does
  [ -z "$links" ] || PIP_ARGS+=(--build-arg TORCH_INDEX_URL=)
}

pip_conf() {  # KEY: the host pip config's value (global or env), without quotes
  "$PY" -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'$/\1/p" | head -1
}

build_image() {  # IMAGE DOCKERFILE CONTEXT [ARGS...]
  local image=$1 file=$2 context=$3 start
  shift 3
  start=$(now)
  local net=()
  [ "$ENGINE" = podman ] && net=(--network=host)
  run_logged "$DIR/logs/build-$(short "$image").log" \
    nice -n 10 "${ENG[@]}" build "${net[@]}" -f "$file" -t "$image" "$@" "$context"
  fact "build_$(short "$image")_s" "$(since "$start")"
}

build() {
  local t0 base_py base_redis base_nginx
  t0=$(now)
  run mkdir -p "$DIR/logs"
  podman_conf
  if [ "$BASE_MODE" = local ]; then
    base_py=localhost/sparkv-debian-py:$SUITE
    base_redis=localhost/sparkv-debian-redis:$SUITE
    base_nginx=localhost/sparkv-debian-nginx:$SUITE
    debian_base "$base_py" ca-certificates,python3,python3-venv,passwd
    debian_base "$base_redis" redis-server
    debian_base "$base_nginx" nginx-light
  else
    base_py=python:3.11-slim base_redis=debian:bookworm-slim base_nginx=debian:bookworm-slim
  fi
  fact bases_s "$(since "$t0")"
  build_image "$REDIS_IMAGE" deploy/images/redis.Dockerfile deploy/images --build-arg "BASE_IMAGE=$base_redis"
  build_image "$NGINX_IMAGE" deploy/images/nginx.Dockerfile deploy/images --build-arg "BASE_IMAGE=$base_nginx"
  pip_build_args
  build_image "$SERVER_IMAGE" deploy/Dockerfile . --build-arg "BASE_IMAGE=$base_py" \
    --build-arg "SPARKV_EXTRAS=$EXTRAS" "${PIP_ARGS[@]}"
  fact build_s "$(since "$t0")"
  say "built $SERVER_IMAGE, $REDIS_IMAGE, $NGINX_IMAGE in $(since "$t0") s"
}

start() {  # NAME IMAGE [ENGINE RUN ARGS...] -- [COMMAND...]: one detached container
  local name=$1 image=$2
  shift 2
  local opts=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  # --init: a signal reaches the process (PID 1 ignores SIGTERM without a handler)
  run "${ENG[@]}" run -d --init --name "$name" --label "$LABEL" --network=host "${opts[@]}" "$image" "$@"
}

write_config() {  # the topology's server config and its one tenant's key, in $DIR
  [ "$DRY_RUN" = 1 ] && { say "(dry run: $DIR/server.yaml, $DIR/api-key)"; return 0; }
  "$PY" - "$DIR" <<'PYEOF'
import sys
from pathlib import Path
from sparkv.server.process import write_config
d = Path(sys.argv[1])
keys = write_config(d / "server.yaml", ["demo"], default_levels=["q8"], default_chunk_tokens=64,
                    manifest_cache_s=1.0, queue_claim_idle_s=2.0, max_job_attempts=3,
                    torch_threads=1)
(d / "api-key").write_text(keys["demo"] + "\n")
PYEOF
  chmod 644 "$DIR/server.yaml"
  chmod 600 "$DIR/api-key"
}

render_nginx() {  # deploy/nginx.conf for the container: DIR inside it, upstreams on loopback
  local ups="" i
  for i in $(seq 1 "$API"); do
    ups+="        server 127.0.0.1:$((API_PORT + i - 1)) max_fails=1 fail_timeout=3s;\n"
  done
  [ "$DRY_RUN" = 1 ] && { say "(dry run: $DIR/nginx.conf)"; return 0; }
  sed -e "s|@USER_LINE@|user www-data;|" -e "s|@WORKERS@|2|" -e "s|@DIR@|/var/cache/sparkv|g" \
      -e "s|@LISTEN@|127.0.0.1:$PORT|" -e "s|@CACHE_MAX@|1g|" -e "s|@FRAME_CACHE_S@|60|" \
      -e "s|@UPSTREAMS@|$ups|" deploy/nginx.conf >"$DIR/nginx.conf"
  chmod 644 "$DIR/nginx.conf"
}

server_env() {  # the environment every sparkv container gets
  SRV=(-v "$DIR/server.yaml:/etc/sparkv/server.yaml:ro" -e SPARKV_CONFIG=/etc/sparkv/server.yaml
       -e "SPARKV_STORE=redis://127.0.0.1:$REDIS_PORT/0" -e SPARKV_JOB_QUEUE=redis
       -e SPARKV_TORCH_THREADS=1 -e OMP_NUM_THREADS=1 -e SPARKV_LOG_LEVEL=warning)
}

wait_http() {  # URL TIMEOUT_S CONTAINER
  [ "$DRY_RUN" = 1 ] && { echo "+ wait for $1"; return 0; }
  local deadline=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    curl -fsS -o /dev/null --max-time 2 "$1" 2>/dev/null && return 0
    [ "$("${ENG[@]}" inspect -f '{{.State.Running}}' "$3" 2>/dev/null)" = true ] || break
    sleep 0.5
  done
  "${ENG[@]}" logs --tail 30 "$3" >&2 || true
  die "$3 did not answer $1"
}

wait_redis() {
  [ "$DRY_RUN" = 1 ] && { echo "+ wait for redis on $REDIS_PORT"; return 0; }
  local i
  for i in $(seq 1 100); do
    "${ENG[@]}" exec "$NAME-redis" redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  die "redis did not start ($ENGINE logs $NAME-redis)"
}

check_ports() {
  [ "$DRY_RUN" = 1 ] && return 0
  local p i
  for p in "$PORT" "$REDIS_PORT" $(for i in $(seq 1 "$API"); do echo $((API_PORT + i - 1)); done); do
    if "$PY" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $p)) != 0)"; then
      die "port $p is taken (set SPARKV_CT_PORT / SPARKV_CT_API_PORT / SPARKV_CT_REDIS_PORT)"
    fi
  done
}

up() {
  local t0 i
  t0=$(now)
  [ "$API" -ge 1 ] && [ "$WORKERS" -ge 1 ] || die "SPARKV_API_REPLICAS and SPARKV_WORKERS must be >= 1"
  run mkdir -p "$DIR"
  check_ports
  write_config
  render_nginx
  server_env
  start "$NAME-redis" "$REDIS_IMAGE" -- --port "$REDIS_PORT" --bind 127.0.0.1 --dir /data \
    --appendonly yes --appendfsync everysec --save ""
  wait_redis
  for i in $(seq 1 "$API"); do
    start "$NAME-api-$i" "$SERVER_IMAGE" "${SRV[@]}" -e SPARKV_HOST=127.0.0.1 \
      -e "SPARKV_PORT=$((API_PORT + i - 1))" -- serve
  done
  for i in $(seq 1 "$WORKERS"); do
    start "$NAME-worker-$i" "$SERVER_IMAGE" "${SRV[@]}" -e SPARKV_WORKER_HEARTBEAT_FILE=/tmp/alive \
      -- worker --name "worker-$i"
  done
  for i in $(seq 1 "$API"); do
    wait_http "http://127.0.0.1:$((API_PORT + i - 1))/healthz" 240 "$NAME-api-$i"
  done
  start "$NAME-nginx" "$NGINX_IMAGE" -v "$DIR/nginx.conf:/etc/sparkv/nginx.conf:ro" --
  wait_http "http://127.0.0.1:$PORT/healthz" 60 "$NAME-nginx"
  fact up_s "$(since "$t0")"
  say "up: http://127.0.0.1:$PORT (API key in $DIR/api-key; $API replicas, $WORKERS workers)"
}

down() {
  local ids
  if [ "$DRY_RUN" = 1 ]; then
    echo "+ ${ENG[*]} stop -t 15 \$(${ENG[*]} ps -aq --filter label=$LABEL)"
    echo "+ ${ENG[*]} rm -f -v \$(${ENG[*]} ps -aq --filter label=$LABEL)"; return 0
  fi
  ids=$("${ENG[@]}" ps -aq --filter "label=$LABEL" 2>/dev/null || true)
  if [ -n "$ids" ]; then  # SIGTERM, SIGKILL after 15 s (docker rm has no -t); -v: /data too
    # shellcheck disable=SC2086 # one id per word
    "${ENG[@]}" stop -t 15 $ids >/dev/null 2>&1 || true
    # shellcheck disable=SC2086
    "${ENG[@]}" rm -f -v $ids >/dev/null
  fi
  say "down: no $NAME containers or their volumes left (images kept)"
}

image_facts() {  # sizes and versions for the summary
  [ "$DRY_RUN" = 1 ] && return 0
  local image
  for image in "$SERVER_IMAGE" "$REDIS_IMAGE" "$NGINX_IMAGE"; do
    fact "size_$(short "$image")_bytes" "$("${ENG[@]}" image inspect -f '{{.Size}}' "$image")"
  done
  fact engine "$("${ENG[@]}" --version | head -1)"
  command -v runc >/dev/null && fact runtime "$(runc --version | head -1)"
  fact base_mode "$BASE_MODE"
  fact image_versions "$("${ENG[@]}" run --rm --network=host --entrypoint python "$SERVER_IMAGE" -c \
    'import sys, torch, transformers, sparkv; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, sparkv {sparkv.__version__}")')"
  fact redis_version "$("${ENG[@]}" run --rm --network=host "$REDIS_IMAGE" --version)"
  fact nginx_version "$("${ENG[@]}" run --rm --network=host --entrypoint nginx "$NGINX_IMAGE" -v 2>&1)"
}

check() {  # the host's side of the test: an edge ask, then one API container killed under load
  run env PYTHONPATH="$ROOT" "$PY" deploy/container_check.py --url "http://127.0.0.1:$PORT" \
    --key-file "$DIR/api-key" --kill "${ENG[*]} kill $NAME-api-1" --facts "$DIR/facts.txt" \
    --json "$JSON"
}

test_all() {
  local t0
  t0=$(now)
  run mkdir -p "$DIR"
  [ "$DRY_RUN" = 1 ] || : >"$DIR/facts.txt"
  fact started_at "$t0"
  trap 'rc=$?; if [ $rc != 0 ]; then say "failed (exit $rc): removing the containers"; down; fi' EXIT
  down
  build
  image_facts
  up
  check
  down
  trap - EXIT
  if [ "$DRY_RUN" = 1 ]; then say "dry run: nothing was run"; return 0; fi
  say "test passed in $(since "$t0") s; summary: $JSON"
}

pick_engine
case "${1:-}" in
  build) build ;;
  up) trap 'rc=$?; [ $rc = 0 ] || down' EXIT; up; trap - EXIT ;;
  test) test_all ;;
  down) down ;;
  *) echo "usage: bash deploy/container.sh [--dry-run] build|up|test|down (settings: the top of this file)" >&2; exit 2 ;;
esac
