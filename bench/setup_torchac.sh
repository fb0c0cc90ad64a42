#!/usr/bin/env bash
# torchac (the arithmetic coder CacheGen uses) for `sparkv bench codec`'s CacheGen-style
# comparison. It is a pure-Python wheel whose C++ extension torch compiles (with ninja and a C++
# compiler) on first import. Installed with --no-deps into the project's venv so that it cannot
# pull another torch: the project's torch (2.13.0, CPU) stays. Without torchac the benchmark
# reports the ideal arithmetic-coded size (the sum of -log2 p) instead.
#
#   bash bench/setup_torchac.sh            # into .venv (or $VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
before="$("$PY" -c 'import torch; print(torch.__version__)')"
"$PY" -m pip install --no-deps "torchac==0.9.3"
command -v ninja >/dev/null || "$PY" -m pip install ninja
# build the extension now (about 25 s), not in the middle of a benchmark
"$PY" -c 'import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    import torchac
print("torchac", torchac.__file__, "built")'
after="$("$PY" -c 'import torch; print(torch.__version__)')"
if [ "$before" != "$after" ]; then
    echo "torch changed from $before to $after: reinstall the project's torch" >&2
    exit 1
fi
