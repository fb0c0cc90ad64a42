#!/usr/bin/env bash
# A separate venv with NVIDIA's kvpress, for `sparkv bench presses --kvpress`: the peer the
# presses are compared with (docs/presses.md). kvpress needs transformers < 5.3, the project runs
# 5.x, so it gets its own venv: bench/.kvpress-venv (ignored by git: it holds a `*` .gitignore).
# torch 2.13.0 (the CPU build, as deploy/setup.sh installs it) goes in first, so that kvpress's
# `torch` requirement cannot pull a CUDA build. Idempotent.
#
#   bash bench/setup_kvpress.sh            # then: sparkv bench presses --kvpress
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVPRESS_VENV:-bench/.kvpress-venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    echo "setup_kvpress: making $VENV"
    python3 -m venv "$VENV"
fi
echo '*' > "$VENV/.gitignore"
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
echo "setup_kvpress: torch 2.13.0 (CPU)"
pip install "torch==2.13.0"
echo "setup_kvpress: kvpress, transformers<5.3"
pip install "kvpress==0.5.5" "transformers>=4.56,<5.3"
"$PY" - <<'PY'
import torch, transformers, kvpress
print(f"setup_kvpress: ok: kvpress {getattr(kvpress, '__version__', '0.5.5')}, transformers "
      f"{transformers.__version__}, torch {torch.__version__} (cuda: {torch.cuda.is_available()})")
PY
