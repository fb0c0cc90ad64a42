#!/usr/bin/env bash
# A sparkv cluster on one machine, all on loopback (docs/cluster.md): Debian's redis-server (the
# shared store and job queue), N stateless API replicas (`sparkv serve --job-queue redis`), M encode
# workers (`sparkv worker`) and nginx in front (deploy/nginx.conf: balancing, retries on another
# replica, the frame cache). The same topology as docker-compose.yml, without a docker engine.
#
#   bash deploy/cluster.sh start     # start everything, wait until healthy, print the URL
#   bash deploy/cluster.sh status    # every process: pid, alive, health
#   bash deploy/cluster.sh stop      # SIGTERM everything (SIGKILL after 10 s)
#
# Settings (environment):
#   SPARKV_CLUSTER_DIR     state directory (default ./sparkv-cluster): pids, logs, cache, cluster.env
#   SPARKV_API_REPLICAS    API replicas (default 2)      SPARKV_WORKERS   encode workers (default 1)
#   SPARKV_CLUSTER_PORT    nginx's port (default 8080; 0: a free port)
#   SPARKV_CONFIG          server config file (tenants, models; default deploy/server-config.example.yaml)
#   SPARKV_REDIS_PORT      redis-server's port (default: a free one)
#   SPARKV_TORCH_THREADS   PyTorch threads per process (default 1)
#   SPARKV_NGINX_WORKERS   nginx worker processes (default auto)   SPARKV_CACHE_MAX (default 2g)
#   SPARKV_FRAME_CACHE_S   seconds nginx serves a cached frame before revalidating it (default 60)
#   SPARKV_REDIS_AOF       yes: redis appendonly persistence (default no)
# After `start`, $SPARKV_CLUSTER_DIR/cluster.env holds SPARKV_URL, SPARKV_REDIS_URL and the ports.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${SPARKV_CLUSTER_DIR:-$ROOT/sparkv-cluster}
API=${SPARKV_API_REPLICAS:-2}
WORKERS=${SPARKV_WORKERS:-1}
PORT=${SPARKV_CLUSTER_PORT:-8080}
CONFIG=${SPARKV_CONFIG:-$ROOT/deploy/server-config.example.yaml}
PY=${PYTHON:-$ROOT/.venv/bin/python}
THREADS=${SPARKV_TORCH_THREADS:-1}
NGINX_WORKERS=${SPARKV_NGINX_WORKERS:-auto}
CACHE_MAX=${SPARKV_CACHE_MAX:-2g}
FRAME_CACHE_S=${SPARKV_FRAME_CACHE_S:-60}
AOF=${SPARKV_REDIS_AOF:-no}
RUN=$DIR/run
LOGS=$DIR/logs

die() { echo "cluster: $*" >&2; exit 1; }
say() { echo "cluster: $*"; }
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_http() {  # URL TIMEOUT_S PIDFILE
  local url=$1 deadline=$(( $(date +%s) + $2 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null; then return 0; fi
    if [ -n "${3:-}" ] && ! alive "$3"; then return 1; fi
    sleep 0.2
  done
  return 1
}

start_api() {  # I PORT
  local i=$1 port=$2
  echo "$port" >"$RUN/api-$i.port"
  OMP_NUM_THREADS=$THREADS PYTHONUNBUFFERED=1 nohup "$PY" -m sparkv.cli serve --host 127.0.0.1 \
    --port "$port" --store "$STORE" --job-queue redis --config "$CONFIG" \
    --threads "$THREADS" --log-level warning >>"$LOGS/api-$i.log" 2>&1 &
  echo $! >"$RUN/api-$i.pid"
}

start_worker() {  # I
  local i=$1
  OMP_NUM_THREADS=$THREADS PYTHONUNBUFFERED=1 nohup "$PY" -m sparkv.cli worker --store "$STORE" \
    --config "$CONFIG" --name "worker-$i" --threads "$THREADS" \
    >>"$LOGS/worker-$i.log" 2>&1 &
  echo $! >"$RUN/worker-$i.pid"
}

render_nginx() {  # writes $DIR/nginx.conf from deploy/nginx.conf
  local ups="" user_line="" i
  for i in $(seq 1 "$API"); do
    ups+="        server 127.0.0.1:$(cat "$RUN/api-$i.port") max_fails=1 fail_timeout=3s;\n"
  done
  if [ "$(id -u)" = 0 ]; then  # workers drop to www-data when it can reach the directory
    user_line="user root;"
    if chown -R www-data "$DIR/cache" "$DIR/tmp" 2>/dev/null &&
       runuser -u www-data -- test -w "$DIR/cache" 2>/dev/null; then
      user_line="user www-data;"
    else
      echo "cluster: www-data cannot reach $DIR; nginx workers run as root" >&2
    fi
  fi
  sed -e "s|@USER_LINE@|$user_line|" -e "s|@WORKERS@|$NGINX_WORKERS|" -e "s|@DIR@|$DIR|g" \
      -e "s|@LISTEN@|127.0.0.1:$PORT|" -e "s|@CACHE_MAX@|$CACHE_MAX|" \
      -e "s|@FRAME_CACHE_S@|$FRAME_CACHE_S|" \
      -e "s|@UPSTREAMS@|$ups|" "$ROOT/deploy/nginx.conf" >"$DIR/nginx.conf"
}

start() {
  command -v redis-server >/dev/null || die "redis-server is not installed (apt-get install redis-server)"
  command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || die "nginx is not installed (apt-get install nginx-light)"
  NGINX=$(command -v nginx || echo /usr/sbin/nginx)
  [ -x "$PY" ] || die "$PY not found: run deploy/setup.sh first"
  [ -f "$CONFIG" ] || die "config file $CONFIG not found"
  [ "$API" -ge 1 ] && [ "$WORKERS" -ge 0 ] || die "SPARKV_API_REPLICAS must be >= 1, SPARKV_WORKERS >= 0"
  if alive "$RUN/redis.pid" || alive "$DIR/nginx.pid"; then
    die "a cluster is already running in $DIR (bash deploy/cluster.sh stop)"
  fi
  mkdir -p "$RUN" "$LOGS" "$DIR/redis" "$DIR/cache" "$DIR/tmp"
  chmod 700 "$DIR/cache"
  rm -f "$RUN"/*.pid "$RUN"/*.port
  [ "$PORT" = 0 ] && PORT=$(free_port)
  local rport=${SPARKV_REDIS_PORT:-$(free_port)}
  STORE="redis://127.0.0.1:$rport/0"
  say "redis-server on 127.0.0.1:$rport"
  nohup redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly "$AOF" \
    --dir "$DIR/redis" --protected-mode yes --loglevel warning >>"$LOGS/redis.log" 2>&1 &
  echo $! >"$RUN/redis.pid"
  local ok=0
  for _ in $(seq 1 100); do
    if redis-cli -p "$rport" ping >/dev/null 2>&1; then ok=1; break; fi
    sleep 0.1
  done
  [ "$ok" = 1 ] || die "redis-server did not start (see $LOGS/redis.log)"
  local i
  for i in $(seq 1 "$API"); do start_api "$i" "$(free_port)"; done
  for i in $(seq 1 "$WORKERS"); do start_worker "$i"; done
  say "$API API replicas, $WORKERS workers starting (logs in $LOGS)"
  for i in $(seq 1 "$API"); do
    wait_http "http://127.0.0.1:$(cat "$RUN/api-$i.port")/healthz" 180 "$RUN/api-$i.pid" ||
      { tail -20 "$LOGS/api-$i.log" >&2; stop; die "API replica $i did not become healthy"; }
  done
  render_nginx
  "$NGINX" -t -q -p "$DIR" -c "$DIR/nginx.conf" 2>>"$LOGS/nginx-error.log" ||
    { tail -5 "$LOGS/nginx-error.log" >&2; stop; die "nginx rejected $DIR/nginx.conf"; }
  "$NGINX" -p "$DIR" -c "$DIR/nginx.conf"
  wait_http "http://127.0.0.1:$PORT/healthz" 30 || { stop; die "nginx did not answer"; }
  {
    echo "SPARKV_URL=http://127.0.0.1:$PORT"
    echo "SPARKV_REDIS_URL=$STORE"
    echo "SPARKV_API_PORTS=\"$(for i in $(seq 1 "$API"); do printf '%s ' "$(cat "$RUN/api-$i.port")"; done)\""
    echo "SPARKV_API_REPLICAS=$API"
    echo "SPARKV_WORKERS=$WORKERS"
  } >"$DIR/cluster.env"
  say "ready: http://127.0.0.1:$PORT (store and queue $STORE; $DIR/cluster.env)"
}

stop_pid() {  # PIDFILE
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

stop() {
  if [ -f "$DIR/nginx.pid" ]; then stop_pid "$DIR/nginx.pid"; fi
  local f waits=()
  for f in "$RUN"/worker-*.pid "$RUN"/api-*.pid; do
    if [ -e "$f" ]; then stop_pid "$f" & waits+=($!); fi
  done
  [ ${#waits[@]} -gt 0 ] && wait "${waits[@]}"
  stop_pid "$RUN/redis.pid"
  say "stopped"
}

status() {
  local f name rc=0
  [ -d "$RUN" ] || { say "no cluster in $DIR"; return 1; }
  for f in "$RUN"/redis.pid "$RUN"/api-*.pid "$RUN"/worker-*.pid "$DIR"/nginx.pid; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .pid)
    if alive "$f"; then
      local health="up"
      if [ -f "$RUN/$name.port" ]; then
        curl -fsS -o /dev/null --max-time 2 "http://127.0.0.1:$(cat "$RUN/$name.port")/healthz" \
          && health="healthy" || health="not answering"
      fi
      printf '%-10s pid %-8s %s\n' "$name" "$(cat "$f")" "$health"
    else
      printf '%-10s pid %-8s dead\n' "$name" "$(cat "$f")"; rc=1
    fi
  done
  [ -f "$DIR/cluster.env" ] && cat "$DIR/cluster.env"
  return $rc
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: bash deploy/cluster.sh start|stop|status (settings: see the top of this file)" >&2; exit 2 ;;
esac
