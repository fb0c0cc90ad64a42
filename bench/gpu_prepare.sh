#!/usr/bin/env bash
# Readies this checkout for bench/gpu_check.sh on a device machine that cannot reach PyPI and
# holds only its image's packages (docs/gpu.md, "Running the check"):
#
#   bash bench/gpu_prepare.sh            # wheels into .whl/, the tokenizer into .gpu/tok
#   bash bench/gpu_prepare.sh hide       # bench/results aside (the tree that travels is
#   bash bench/gpu_prepare.sh restore    #   limited to 64 MiB; bench/results is most of it)
#
# The wheels are the server's and the wire's packages the device image lacks, at the versions
# this checkout's venv runs (fastapi 0.165 imports opentelemetry: the H200's run 3 found it
# missing). Both folders are ignored through .git/info/exclude, so a device call names them in
# its carry: [".whl", ".gpu"].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
HIDDEN=../.sparkv-results-hidden
case "${1:-wheels}" in
  hide)
    [ -e "$HIDDEN" ] && { echo "gpu_prepare: $HIDDEN exists: restore first"; exit 1; }
    mv bench/results "$HIDDEN" && mkdir bench/results && echo "bench/results moved to $HIDDEN"
    exit 0 ;;
  restore)
    [ -d "$HIDDEN" ] || { echo "gpu_prepare: nothing hidden at $HIDDEN"; exit 1; }
    rmdir bench/results 2>/dev/null || { echo "gpu_prepare: bench/results is not empty"; exit 1; }
    mv "$HIDDEN" bench/results && echo "bench/results restored"
    exit 0 ;;
  wheels) ;;
  *) echo "usage: bash bench/gpu_prepare.sh [wheels|hide|restore]"; exit 2 ;;
esac
for ignored in /.whl/ /.gpu/; do
  grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
PACKAGES="fastapi starlette pydantic pydantic_core annotated-types typing-inspection
  typing_extensions opentelemetry-api uvicorn cryptography cffi pycparser redis PuLP gguf"
pins=()
for p in $PACKAGES; do
  pins+=("$p==$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")")
done
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
rm -rf .whl && mkdir .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${pins[@]}"
tok=$($PY -c "from sparkv.runtime.model import cache_dir
print(cache_dir() / 'models' / 'SmolLM2-135M-Instruct')")
rm -rf .gpu/tok && mkdir -p .gpu/tok
cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$tok"/chat_template.jinja .gpu/tok/
tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {printf "%d", s / 1048576}')
echo "gpu_prepare: $(ls .whl | wc -l) wheels ($(du -sm .whl | cut -f1) MiB)," \
  "tokenizer in .gpu/tok; tracked files ${tracked} MiB (the device tool takes 64 MiB in all:" \
  "'hide' if over)"
cat <<'EOF'
then two device calls, carry [".whl", ".gpu"] (docs/gpu.md), each one command line:
  export SPARKV_TOKENIZER=$PWD/.gpu/tok GPU_CHECK_WHEELS=$PWD/.whl \
    GPU_CHECK_PHASES="tests attention prefill1k devicekv"; \
    bash bench/gpu_check.sh $OUT 2>&1 | tee $OUT/gpu_check.log
  export SPARKV_TOKENIZER=$PWD/.gpu/tok GPU_CHECK_WHEELS=$PWD/.whl \
    GPU_CHECK_PHASES="ttftlong ttftswitch"; \
    bash bench/gpu_check.sh $OUT 2>&1 | tee $OUT/gpu_check-ttftlong.log
EOF
