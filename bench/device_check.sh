#!/bin/bash
# The GPU check (issue 21): one script, under 8 minutes on one H200 with 16 cores.
#
#   bench/device_check.sh [OUT_DIR]        (default: $OUT, else ./device-check)
#
# It builds EDDIS's native extensions from the working tree where they are not
# built (with the packages bench/device_bundle.sh put into .devbundle/ where the
# machine lacks UCX or MPI), then:
#   1. tests/test_torch_cuda.py (sync and allreduce, none/fp16/bf16, AMP with
#      GradScaler, 1 and 2 ranks sharing the GPU, each against one process on the
#      global batch) and the timeline/overlap tests, with -rs;
#   2. (inside 1) the equivalence figures: fp32 relative error < 1e-5, fp16/bf16
#      within the tests' tolerance;
#   3. the single-rank overhead on the GPU (bench/compare_torch.py's method, plain
#      models as the noise floor) and the timeline overhead on a ResNet-18;
#   4. bench/compare_torch.py with 4 ranks on the host's cores;
#   5. summary.txt: each step's status, the test counts and every figure.
# DEVICE_CHECK_STEPS (comma-separated, default all: tests,overhead-gpu,timeline-gpu,
# compare-4-ranks) runs only those steps, for a rerun of what failed or changed.
# Where no GPU is visible the CUDA steps say so in one line and are counted as
# skipped, never as passed. The script's status is 0 only if no step failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-device-check}}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
budget=${DEVICE_CHECK_BUDGET_S:-450}
start=$SECONDS
failed=0
cpus=$(getconf _NPROCESSORS_ONLN)   # before OMP_NUM_THREADS=1, which nproc would obey
say() { echo "device_check: $*" | tee -a "$summary"; }
all_steps=tests,overhead-gpu,timeline-gpu,compare-4-ranks
steps=${DEVICE_CHECK_STEPS:-$all_steps}
for step in ${steps//,/ }; do
    [[ ",$all_steps," == *",$step,"* ]] || { echo "device_check: DEVICE_CHECK_STEPS: no step $step (steps: $all_steps)" >&2; exit 2; }
done
wanted() { [[ ",$steps," == *",$1,"* ]]; }
left() { echo $((budget - (SECONDS - start))); }
# run NAME SECONDS CMD...: one step, bounded, its output in $out/NAME.log
run() {
    local name=$1 limit=$2; shift 2
    local room; room=$(left)
    [ "$limit" -gt "$room" ] && limit=$room
    if [ "$limit" -lt 20 ]; then
        say "$name: NOT RUN (budget of ${budget}s spent)"; failed=1; return 1
    fi
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    [ $rc -eq 124 ] && verdict="TIMED OUT after ${limit}s"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="FAILED (status $rc)"
    [ $rc -ne 0 ] && failed=1
    say "$name: $verdict in $((SECONDS - t0))s"
    return $rc
}

say "$(date -u '+%F %T UTC'), $cpus CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    | sed 's/^/device_check: gpu: /' | tee -a "$summary"

# --- prerequisites: packages carried in .devbundle (see bench/device_bundle.sh)
# DEVICE_CHECK_BUNDLE: auto (use the bundle where mpirun or UCX's headers are missing),
# always, or never. The bundle is taken whole (its MPI, UCX and mpi4py together), since
# an mpi4py built against another MPI cannot be mixed with the bundle's libmpi.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
use_bundle=${DEVICE_CHECK_BUNDLE:-auto}
case $use_bundle in
auto) use_bundle=0
      compgen -G ".devbundle/*.deb" >/dev/null && ! { command -v mpirun && pkg-config --exists ucx; } >/dev/null 2>&1 \
          && use_bundle=1 ;;
always) use_bundle=1 ;;
never) use_bundle=0 ;;
*) echo "device_check: DEVICE_CHECK_BUNDLE=$use_bundle: say auto, always or never" >&2; exit 2 ;;
esac
if [ $use_bundle = 1 ]; then
    compgen -G ".devbundle/*.deb" >/dev/null || { say "no .devbundle/*.deb: run bench/device_bundle.sh here and carry .devbundle"; exit 2; }
    root=/tmp/eddis-devroot
    mkdir -p "$root"
    for deb in .devbundle/*.deb; do dpkg -x "$deb" "$root"; done
    # dpkg -x leaves out Debian's alternatives: mpirun, mpicc and the rest exist only
    # as NAME.openmpi until a link gives them their plain names
    for tool in "$root"/usr/bin/*.openmpi; do ln -sfn "$(basename "$tool")" "${tool%.openmpi}"; done
    arch=x86_64-linux-gnu
    export PATH=$root/usr/bin:$PATH
    export LD_LIBRARY_PATH=$root/usr/lib/$arch:$root/usr/lib/$arch/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export CPATH=$root/usr/include:$root/usr/lib/$arch/openmpi/include${CPATH:+:$CPATH}
    export LIBRARY_PATH=$LD_LIBRARY_PATH
    # first on the link line too, ahead of any UCX or MPI in the system's library folders
    export LDFLAGS="-L$root/usr/lib/$arch -L$root/usr/lib/$arch/openmpi/lib${LDFLAGS:+ $LDFLAGS}"
    export PKG_CONFIG_PATH=$root/usr/lib/$arch/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    export OPAL_PREFIX=$root/usr UCX_MODULE_DIR=$root/usr/lib/$arch/ucx
    # PMIx looks for its plugins where Debian put them: on a machine with another PMIx
    # there, it loads theirs ("undefined symbol: pmix_output_info")
    export PMIX_MCA_mca_base_component_path=$root/usr/lib/$arch/pmix2/lib/pmix
    say "prerequisites: $(ls .devbundle/*.deb | wc -l) packages from .devbundle unpacked into $root"
fi
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
if [ $use_bundle = 1 ]; then
    # built against the same Open MPI by bench/device_bundle.sh for the GPU machine's Python,
    # which saves minutes of device time; built here from the source otherwise
    prebuilt=.devbundle/site-py$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ -d "$prebuilt/mpi4py" ]; then
        export PYTHONPATH=$PWD/$prebuilt:$PYTHONPATH
        say "mpi4py: the one prebuilt in $prebuilt"
    else
        compgen -G ".devbundle/mpi4py-*.tar.gz" >/dev/null || { say "no mpi4py source in .devbundle"; exit 2; }
        run mpi4py 240 "$PY" -m pip install -q --no-index --no-build-isolation --no-deps --target /tmp/eddis-site \
            .devbundle/mpi4py-*.tar.gz || { say "mpi4py did not build against the bundle's MPI: see $out/mpi4py.log"; exit 1; }
        export PYTHONPATH=/tmp/eddis-site:$PYTHONPATH
    fi
fi
say "mpi: $(mpirun --version 2>&1 | head -n 1); ucx: $(ucx_info -v 2>&1 | grep -m1 -i 'version' | tr -d '#'); mpi4py: $("$PY" -c \
    'import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(mpi4py.__version__, mpi4py.__file__, MPI.Get_library_version().splitlines()[0])' 2>&1 | tr -d '\0' | tail -n 1)"
say "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)' 2>&1)"

# --- build: a missing extension is a failure of the check, never a skip
if ! "$PY" -c "import eddis.smb._core, eddis._mpi" 2>/dev/null; then
    run build 300 "$PY" setup.py build_ext --inplace || {
        say "the native extensions did not build: see $out/build.log; nothing else can run"
        exit 1
    }
fi
gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
[ "$gpu" = 1 ] || say "no CUDA GPU visible to torch: the CUDA steps below are SKIPPED, not passed"

# --- 1 and 2: the CUDA tests and the timeline/overlap tests
if wanted tests; then
    run tests 270 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$out/tests.xml" \
        tests/test_torch_cuda.py tests/test_torch_overlap.py tests/test_timeline_runtime.py
    tail -n 15 "$out/tests.log" | grep -E "passed|failed|skipped|error|SKIPPED" | sed 's/^/device_check: tests: /' \
        | tee -a "$summary"
fi

# --- 3: overhead on the GPU (single rank): the small models step in 1-2 ms there, so
# ResNet-18 on 224 x 224 images gives the figure of a step of real size beside them
if [ "$gpu" = 1 ]; then
    if wanted overhead-gpu; then
        models=compute,comm
        if "$PY" -c "import torchvision" 2>/dev/null; then models=resnet18,$models
        else say "overhead-gpu: no torchvision, so no ResNet-18 (compute and comm only)"; fi
        run overhead-gpu 180 "$PY" bench/compare_torch.py --ranks 1 --models "$models" --device cuda \
            --single-rounds 30 --single-launches 1
        grep -E "^\| (resnet18|compute|comm)," "$out/overhead-gpu.log" | sed 's/^/device_check: overhead-gpu: /' \
            | tee -a "$summary"
    fi
    if wanted timeline-gpu; then
        run timeline-gpu 90 "$PY" bench/timeline_overhead.py --device cuda --model resnet18 --steps 200
        tail -n 6 "$out/timeline-gpu.log" | sed 's/^/device_check: timeline-gpu: /' | tee -a "$summary"
    fi
else
    wanted overhead-gpu && say "overhead-gpu: SKIPPED (no GPU)"
    wanted timeline-gpu && say "timeline-gpu: SKIPPED (no GPU)"
fi

# --- 4: the many-core figure: 4 ranks on the host's CPUs
# the contenders of the old 0.82x figure: DDP and EDDIS sync, plain and fp16 on the wire
compare=(--ranks 4 --rounds 2 --models compute,comm --contenders ddp,ddp-fp16,eddis-sync,eddis-sync-fp16)
if [ "$cpus" -lt 8 ] && wanted compare-4-ranks; then
    say "compare-4-ranks: only $cpus CPUs here, so one round of the comm model: the figure means something on the 16-core host only"
    compare=(--ranks 4 --rounds 1 --models comm --contenders ddp,eddis-sync)
fi
if wanted compare-4-ranks; then
    run compare-4-ranks 150 "$PY" bench/compare_torch.py "${compare[@]}" --skip-single
    grep -E "^\|" "$out/compare-4-ranks.log" | sed 's/^/device_check: compare-4-ranks: /' | tee -a "$summary"
fi

say "done in $((SECONDS - start))s, $([ $failed = 0 ] && echo 'no step failed' || echo 'SOME STEPS FAILED')"
exit $failed
