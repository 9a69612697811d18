#!/usr/bin/env bash
# Build Horovod from its PyPI sdist against the venv's torch, cache the wheel, install it.
#
# Horovod 0.28.1 (the last release) asks for C++14 in its CMake files, but the headers of
# torch >= 2.1 need C++17 (DESIGN.md, "Things that bite"). This script downloads the sdist,
# switches the two CMAKE_CXX_STANDARD settings to 17, builds with gloo on and MPI/TF/MXNet off,
# and keeps the wheel in a cache keyed by horovod version, torch version, Python tag, platform
# and cpu/cuda. A cold build takes 5-15 minutes on 2 cores; a cached run takes seconds.
#
# Environment:
#   PYTHON               interpreter of the target venv          (default: .venv/bin/python)
#   SPARKDL_WHEEL_CACHE  where built wheels and build logs go    (default: ~/.cache/sparkdl/wheels)
#   SPARKDL_KEEP_BUILD=1 keep the temporary source/build tree (its path is printed)
#   SPARKDL_HOROVOD_REBUILD=1  ignore the cache and any installed horovod, build again
#   HOROVOD_CMAKE        cmake to use (default: cmake on PATH; horovod's setup.py reads it too)
set -euo pipefail

HOROVOD_VERSION=0.28.1
RUNTIME_DEPS=(cloudpickle psutil pyyaml packaging cffi)
BUILD_DEPS=(wheel setuptools "${RUNTIME_DEPS[@]}")

PYTHON=${PYTHON:-.venv/bin/python}
CACHE=${SPARKDL_WHEEL_CACHE:-$HOME/.cache/sparkdl/wheels}
START=$(date +%s)

log() { echo "[build_horovod] $*"; }
die() { echo "[build_horovod] error: $*" >&2; exit 1; }
elapsed() { echo "$(( $(date +%s) - START ))s"; }

[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 \
  || die "Python '$PYTHON' not found. HINT: run 'make venv' first or set PYTHON=/path/to/venv/bin/python"
# One interpreter start (importing torch costs seconds): facts for the cache key, plus the state of
# any installed horovod (import horovod.torch, hvd.init(), what it was built for).
PROBE=$("$PYTHON" - <<'EOF'
import json, os, sys, sysconfig
try:
    import torch
except Exception as e:
    print(f"TORCH_ERROR={type(e).__name__}: {e}".replace("\n", " "))
    sys.exit(0)
print(f"TORCH_VERSION={torch.__version__}")
print(f"TORCH_CUDA={torch.version.cuda or ''}")
print(f"CUDA_AVAILABLE={int(torch.cuda.is_available())}")
print(f"PY_TAG=cp{sys.version_info[0]}{sys.version_info[1]}")
print("PLATFORM=" + sysconfig.get_platform().replace("-", "_").replace(".", "_"))
print(f"PY_EXE={sys.executable}")
try:
    import horovod
    import horovod.torch as hvd
    with open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")) as f:
        built_for = json.load(f).get("pytorch", "")    # a mismatch is only a warning inside horovod
    hvd.init()
    print(f"HVD_VERSION={horovod.__version__}")
    print(f"HVD_TORCH={built_for}")
    print(f"HVD_GLOO={int(bool(hvd.gloo_built()))}")
    print(f"HVD_NCCL={int(bool(hvd.nccl_built()))}")
    print(f"HVD_SIZE={hvd.size()}")
except Exception:
    pass
EOF
) || die "could not run $PYTHON"
TORCH_ERROR="" TORCH_VERSION="" TORCH_CUDA="" CUDA_AVAILABLE=0 PY_TAG="" PLATFORM="" PY_EXE=""
HVD_VERSION="" HVD_TORCH="" HVD_GLOO=0 HVD_NCCL=0 HVD_SIZE=""
while IFS='=' read -r k v; do
  case $k in
    TORCH_ERROR|TORCH_VERSION|TORCH_CUDA|CUDA_AVAILABLE|PY_TAG|PLATFORM|PY_EXE|HVD_VERSION|HVD_TORCH|HVD_GLOO|HVD_NCCL|HVD_SIZE)
      printf -v "$k" '%s' "$v" ;;
  esac
done <<<"$PROBE"
[ -z "$TORCH_ERROR" ] && [ -n "$TORCH_VERSION" ] \
  || die "torch is not importable with $PYTHON (${TORCH_ERROR:-no output}). HINT: run 'make venv' (installs torch from requirements-dev.txt)"

# ---------------------------------------------------------------------------------- cache key
# CUDA only when there is a compiler, a CUDA build of torch and a GPU to run it on.
VARIANT=cpu
if command -v nvcc >/dev/null 2>&1 && [ -n "$TORCH_CUDA" ]; then
  if [ "$CUDA_AVAILABLE" = 1 ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q .; }; then
    VARIANT=cuda
  fi
fi

KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION//+/_}_${PY_TAG}_${PLATFORM}_${VARIANT}"
KEY_DIR="$CACHE/$KEY"
LOG="$CACHE/build-$KEY.log"   # build-horovod-<version>_torch-..._<variant>.log
log "python $PY_EXE, torch $TORCH_VERSION, variant $VARIANT"
log "cache key: $KEY"

# ------------------------------------------------------------------------------ helpers
# The installed horovod is HOROVOD_VERSION, hvd.init() worked, it was built for this torch and
# has the wanted backends.
installed_ok() {
  [ "$HVD_VERSION" = "$HOROVOD_VERSION" ] && [ "$HVD_TORCH" = "$TORCH_VERSION" ] && [ -n "$HVD_SIZE" ] \
    && [ "$HVD_GLOO" = 1 ] && { [ "$VARIANT" != cuda ] || [ "$HVD_NCCL" = 1 ]; }
}

ensure_pkgs() {  # install only the missing distributions
  local missing
  missing=$("$PYTHON" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
names = {"pyyaml": "PyYAML"}
out = []
for p in sys.argv[1:]:
    try:
        version(names.get(p, p))
    except PackageNotFoundError:
        out.append(p)
print(" ".join(out))
EOF
)
  if [ -n "$missing" ]; then
    log "installing into the venv: $missing"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install --quiet $missing
  fi
}

verify() {
  log "verifying: import horovod.torch; hvd.init()"
  "$PYTHON" -c "import horovod, horovod.torch as hvd; hvd.init(); print(f'[build_horovod] horovod {horovod.__version__}: hvd.size() = {hvd.size()}, gloo_built={hvd.gloo_built()}, nccl_built={hvd.nccl_built()}')"
  log "done in $(elapsed)"
}

install_wheel() {
  log "installing $1"
  "$PYTHON" -m pip install --quiet --no-deps --force-reinstall "$1"
  ensure_pkgs "${RUNTIME_DEPS[@]}"
}

find_cached() { compgen -G "$KEY_DIR/horovod-${HOROVOD_VERSION}-*.whl" | head -n 1 || true; }

# ------------------------------------------------------------------------------ fast paths
if [ "${SPARKDL_HOROVOD_REBUILD:-0}" != 1 ]; then
  if installed_ok; then
    log "horovod $HOROVOD_VERSION is already installed and built for torch $TORCH_VERSION; nothing to do"
    log "verified: import horovod.torch; hvd.init() -> hvd.size() = $HVD_SIZE, gloo_built=$HVD_GLOO, nccl_built=$HVD_NCCL"
    log "done in $(elapsed)"; exit 0
  fi
  WHEEL=$(find_cached)
  if [ -n "$WHEEL" ]; then
    log "using cached wheel"
    install_wheel "$WHEEL"; verify; exit 0
  fi
fi

# ------------------------------------------------------------------------------ build
mkdir -p "$CACHE"
# One build per key at a time (a second 'make horovod' waits, then finds the wheel).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$CACHE/.lock-$KEY"
  if ! flock -n 9; then log "another build of $KEY is running; waiting for it"; flock 9; fi
  WHEEL=$(find_cached)
  if [ -n "$WHEEL" ] && [ "${SPARKDL_HOROVOD_REBUILD:-0}" != 1 ]; then
    log "another run built it meanwhile"; install_wheel "$WHEEL"; verify; exit 0
  fi
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/sparkdl-horovod.XXXXXX")
cleanup() {
  if [ "${SPARKDL_KEEP_BUILD:-0}" = 1 ]; then log "kept build tree: $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT

ensure_pkgs "${BUILD_DEPS[@]}"

log "downloading the horovod==$HOROVOD_VERSION sdist from PyPI"
"$PYTHON" -m pip download --quiet "horovod==$HOROVOD_VERSION" --no-deps --no-binary :all: -d "$TMP/dl"
SDIST=$(compgen -G "$TMP/dl/horovod-${HOROVOD_VERSION}.tar.gz" | head -n 1 || true)
[ -n "$SDIST" ] || die "pip download did not produce horovod-${HOROVOD_VERSION}.tar.gz in $TMP/dl"
tar -xzf "$SDIST" -C "$TMP"
SRC="$TMP/horovod-$HOROVOD_VERSION"
[ -f "$SRC/setup.py" ] || die "unexpected sdist layout: $SRC/setup.py missing"

# --- patch C++14 -> C++17. Each pattern must occur exactly as expected; otherwise stop, because
# the sdist is not the one this patch was written for.
patch_exact() {  # file, sed-regex, replacement, expected-count
  local file="$SRC/$1" re=$2 repl=$3 want=$4 n
  [ -f "$file" ] || die "patch: $1 not found in the sdist"
  n=$(grep -c -- "$re" "$file" || true)
  [ "$n" = "$want" ] || die "patch: expected $want line(s) matching '$re' in $1, found $n. The horovod sdist changed; review scripts/build_horovod.sh"
  sed -i "s/$re/$repl/" "$file"
  grep -q -- "$repl" "$file" || die "patch: sed did not change $1"
  log "patched $1: '$re' -> '$repl' ($n line(s))"
}
patch_exact CMakeLists.txt              'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)' 1
patch_exact horovod/torch/CMakeLists.txt 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)' 1

# Nothing outside third_party/ may still ask for C++14.
LEFT=$(cd "$SRC" && grep -rnE 'CXX_STANDARD[[:space:]]+14|std=(c|gnu)\+\+14|cxx_std_14|std=(c|gnu)\+\+1y' \
         --include=CMakeLists.txt --include='*.cmake' --include=setup.py . | grep -v '^\./third_party/' || true)
[ -z "$LEFT" ] || die "patch: C++14 settings remain after patching:
$LEFT"

# --- toolchain
CMAKE_BIN=${HOROVOD_CMAKE:-$(command -v cmake || true)}
[ -n "$CMAKE_BIN" ] || die "cmake not found. HINT: apt-get install -y cmake (3.13 or newer)"
CMAKE_VER=$("$CMAKE_BIN" --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')
log "cmake $CMAKE_VER ($CMAKE_BIN)"
CMAKE_MAJOR=${CMAKE_VER%%.*}
if [ "${CMAKE_MAJOR:-0}" -ge 4 ]; then
  # gloo/flatbuffers ask for cmake_minimum_required(2.8.12), which cmake 4 refuses.
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  log "cmake >= 4: CMAKE_POLICY_VERSION_MINIMUM=3.5"
fi
export HOROVOD_CMAKE=$CMAKE_BIN

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
       HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1
unset HOROVOD_GPU_OPERATIONS
if [ "$VARIANT" = cuda ]; then export HOROVOD_GPU_OPERATIONS=NCCL; fi
# Overrides the MAKEFLAGS an outer `make horovod` exports (its jobserver is not ours).
export MAKEFLAGS="-j$(nproc)"
unset MAKELEVEL MFLAGS || true

log "building horovod $HOROVOD_VERSION ($VARIANT, $MAKEFLAGS); this takes 5-15 minutes on 2 cores"
log "build log: $LOG"
BUILD_START=$(date +%s)
if ! "$PYTHON" -m pip wheel --no-deps --no-build-isolation -v "$SRC" -w "$TMP/wheel" >"$LOG" 2>&1; then
  echo "----- last 60 lines of $LOG -----" >&2
  tail -n 60 "$LOG" >&2
  echo "---------------------------------" >&2
  die "horovod build failed after $(( $(date +%s) - BUILD_START ))s (full log: $LOG). HINT: SPARKDL_KEEP_BUILD=1 keeps the source tree"
fi
BUILT=$(compgen -G "$TMP/wheel/horovod-${HOROVOD_VERSION}-*.whl" | head -n 1 || true)
[ -n "$BUILT" ] || die "pip wheel succeeded but left no horovod wheel in $TMP/wheel (log: $LOG)"
log "built $(basename "$BUILT") in $(( $(date +%s) - BUILD_START ))s"

mkdir -p "$KEY_DIR"
rm -f "$KEY_DIR"/horovod-*.whl
cp "$BUILT" "$KEY_DIR/.$(basename "$BUILT").part"
mv "$KEY_DIR/.$(basename "$BUILT").part" "$KEY_DIR/$(basename "$BUILT")"   # atomic: no half wheel in the cache
WHEEL="$KEY_DIR/$(basename "$BUILT")"
log "cached $WHEEL"

install_wheel "$WHEEL"
verify
