#!/usr/bin/env bash
# The README's two commands go through here: `demo` (the main job) and `test` (the test suite).
# Both set the machine up first (deploy/setup.sh, idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
case "${1:-}" in
  demo) shift; exec .venv/bin/sparkv demo "$@" ;;
  # the suite on every core and one more (pytest-xdist, a test file per worker: its module
  # fixtures built once; the longest files first, tests/conftest.py). The extra worker fills the
  # time tests wait on sockets, processes and emulated links: 2 cores, quiet: 830 s with 2
  # workers, 680 s with 3.
  # sparkv's bytecode is written once first (also where PYTHONDONTWRITEBYTECODE is set, as in
  # some sandboxes: each of the ~120 processes the suite starts would compile sparkv again).
  test) shift; .venv/bin/python -m compileall -q sparkv tests >/dev/null
    exec .venv/bin/python -m pytest -q -n "${SPARKV_TEST_WORKERS:-$(( $(nproc) + 1 ))}" \
    --dist loadfile --no-loadscope-reorder "$@" ;;
  *) echo "usage: bash deploy/run.sh demo|test [ARGS...]" >&2; exit 2 ;;
esac
