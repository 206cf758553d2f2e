#!/usr/bin/env bash
# Build Horovod 0.28.1 from its source distribution into a venv, for the
# Horovod contenders of bench/compare_torch.py. Benchmark setup only: not part
# of `make test` or CI (the build takes 20+ minutes on a 2-core machine).
#
#   bench/setup_horovod.sh [VENV]        # VENV defaults to the repository's .venv
#
# Environment:
#   HOROVOD_SDIST=PATH   use this horovod-0.28.1.tar.gz instead of downloading it
#                        from the package index (its sha256 is checked either way)
#   HOROVOD_REBUILD=1    rebuild even if a working Horovod 0.28.1 is installed
#   MAKEFLAGS            passed to make; default -j1 (a shared machine). Horovod's
#                        setup.py runs make -j8 unless MAKEFLAGS is set.
#
# Why a patched build: Horovod 0.28.1 compiles its PyTorch extension with
# CMAKE_CXX_STANDARD 14, and torch 2.x headers refuse anything older than C++17
# ("#error C++17 or later compatible compiler is required to use PyTorch",
# torch/csrc/api/include/torch/all.h). Raising the standard to 17 in
# CMakeLists.txt and horovod/torch/CMakeLists.txt is the known upstream fix.
# Checked against torch 2.13.0+cpu, g++ 12.2, Open MPI 4.1, Python 3.11: with
# C++17 the torch sources compile unchanged, nothing else needed patching.
#
# Idempotent: when the venv already imports a Horovod 0.28.1 built against its
# current torch and hvd.init() works, only the checks run. The build happens in
# a temporary folder that is removed afterwards. Already installed packages are
# pinned (pip constraints from `pip freeze`), so installing Horovod cannot
# change torch, numpy or anything requirements-dev.txt installed; only
# Horovod's own missing dependencies (psutil, pyyaml) are added.
set -euo pipefail

HVD_VERSION=0.28.1
HVD_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-$REPO/.venv}
PY=$VENV/bin/python

die() { echo "setup_horovod: $*" >&2; exit 1; }
say() { echo "setup_horovod: $*"; }

[ -x "$PY" ] || die "no python in $VENV (usage: $0 [VENV])"
command -v mpicc >/dev/null || die "mpicc not found: Horovod's MPI controller needs the system MPI (apt: libopenmpi-dev)"
command -v cmake >/dev/null || die "cmake not found (apt: cmake); Horovod's setup.py would otherwise pip-install one"
command -v g++ >/dev/null || die "g++ not found"

# A Horovod that imports, matches this torch and initialises: nothing to build.
installed_ok() {
    "$PY" - "$HVD_VERSION" <<'EOF' >/dev/null 2>&1
import json, os, sys
import horovod
assert horovod.__version__ == sys.argv[1], horovod.__version__
import torch
with open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")) as f:
    meta = json.load(f)
assert meta.get("pytorch") == torch.__version__, (meta, torch.__version__)
import horovod.torch as hvd
hvd.init()
assert hvd.mpi_built()
hvd.shutdown()
EOF
}

# Replace OLD by NEW in FILE, where OLD must occur exactly once: an explicit,
# checked patch that fails loudly if the sdist is not the one it was written for.
patch_once() {
    local file=$1 old=$2 new=$3
    "$PY" - "$file" "$old" "$new" <<'EOF' || die "patching $1 failed (see above)"
import sys
path, old, new = sys.argv[1:4]
text = open(path).read()
n = text.count(old)
if n != 1:
    sys.exit(f"setup_horovod: {path}: expected exactly one {old!r}, found {n}; "
             "is this the Horovod 0.28.1 sdist?")
open(path, "w").write(text.replace(old, new))
print(f"setup_horovod: patched {path}: {old!r} -> {new!r}")
EOF
}

if [ "${HOROVOD_REBUILD:-0}" != 1 ] && installed_ok; then
    say "Horovod $HVD_VERSION already installed in $VENV and working; skipping the build (HOROVOD_REBUILD=1 forces it)"
else
    BUILD=$(mktemp -d "${TMPDIR:-/tmp}/eddis-horovod-build.XXXXXX")
    trap 'rm -rf "$BUILD"' EXIT
    if [ -n "${HOROVOD_SDIST:-}" ]; then
        [ -f "$HOROVOD_SDIST" ] || die "HOROVOD_SDIST=$HOROVOD_SDIST does not exist"
        cp "$HOROVOD_SDIST" "$BUILD/"
    else
        say "downloading the horovod==$HVD_VERSION sdist from the package index"
        "$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation \
            --dest "$BUILD" "horovod==$HVD_VERSION"
    fi
    SDIST=$BUILD/horovod-$HVD_VERSION.tar.gz
    [ -f "$SDIST" ] || die "no $(basename "$SDIST") in $BUILD"
    sum=$(sha256sum "$SDIST" | cut -d' ' -f1)
    [ "$sum" = "$HVD_SHA256" ] || die "$SDIST: sha256 $sum, expected $HVD_SHA256"
    tar -xzf "$SDIST" -C "$BUILD"
    SRC=$BUILD/horovod-$HVD_VERSION

    # torch 2.x headers need C++17 (see the top of this file).
    patch_once "$SRC/CMakeLists.txt" "set(CMAKE_CXX_STANDARD 14)" "set(CMAKE_CXX_STANDARD 17)"
    patch_once "$SRC/horovod/torch/CMakeLists.txt" "set(CMAKE_CXX_STANDARD 14)" "set(CMAKE_CXX_STANDARD 17)"

    # Pin everything already installed, so pip only adds Horovod and its
    # missing pure dependencies. Editable and URL installs cannot be
    # constraints; they are left out (pip does not touch them without a reason).
    "$PY" -m pip freeze --all | grep -E '^[A-Za-z0-9_.-]+==' >"$BUILD/constraints.txt" || true
    cp "$BUILD/constraints.txt" "$BUILD/freeze-before.txt"

    say "building (nice -n 19, MAKEFLAGS=${MAKEFLAGS:--j1}); this takes a while"
    start=$(date +%s)
    nice -n 19 env MAKEFLAGS="${MAKEFLAGS:--j1}" \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI \
        "$PY" -m pip install -v --no-build-isolation --no-cache-dir \
        -c "$BUILD/constraints.txt" "$SRC"
    say "built and installed in $(( $(date +%s) - start )) s"

    # Nothing that was installed before may have changed version.
    "$PY" -m pip freeze --all | grep -E '^[A-Za-z0-9_.-]+==' >"$BUILD/freeze-after.txt" || true
    changed=$(comm -23 <(sort "$BUILD/freeze-before.txt") <(sort "$BUILD/freeze-after.txt"))
    [ -z "$changed" ] || die "installing Horovod changed these packages: $changed"
    added=$(comm -13 <(sort "$BUILD/freeze-before.txt") <(sort "$BUILD/freeze-after.txt") | tr '\n' ' ')
    say "added: ${added:-nothing}"
fi

# Checks: the extension loads and initialises, and horovodrun sees PyTorch + MPI.
say "check: import horovod.torch; hvd.init()"
"$PY" -c "import horovod, horovod.torch as hvd; hvd.init(); print('horovod', horovod.__version__, 'rank', hvd.rank(), 'of', hvd.size(), 'mpi_built', hvd.mpi_built()); hvd.shutdown()"
say "check: horovodrun --check-build"
out=$(PATH="$VENV/bin:$PATH" "$VENV/bin/horovodrun" --check-build)
echo "$out"
grep -qE '\[X\] PyTorch' <<<"$out" || die "horovodrun --check-build: PyTorch not built"
grep -qE '\[X\] MPI' <<<"$out" || die "horovodrun --check-build: MPI not built"
say "Horovod $HVD_VERSION ready in $VENV"
