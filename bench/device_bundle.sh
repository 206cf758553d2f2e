#!/bin/bash
# What bench/device_check.sh needs on a GPU machine that has PyTorch but neither UCX
# nor Open MPI (the lent H200 has no package registry): Debian's packages, downloaded
# here into .devbundle/ (ignored by git; name it in the device run's carry), and the
# mpi4py source, built there against the carried MPI.
#
#   bench/device_bundle.sh          # then: run(command="bench/device_check.sh", carry=[".devbundle"])
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.devbundle/" .git/info/exclude 2>/dev/null || echo "/.devbundle/" >>.git/info/exclude
mkdir -p .devbundle
cd .devbundle
# UCX and Open MPI with the libraries they load that a PyTorch image lacks
packages="libucx0 libucx-dev ucx-utils openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev
  libpmix2 libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libibverbs1 librdmacm1
  libnl-3-200 libnl-route-3-200 libpsm2-2 libpsm-infinipath1 libnuma1 libltdl7 libmunge2"
apt-get download $packages >/dev/null
python3 -m pip download -q --no-deps --no-binary=:all: "mpi4py==$(../.venv/bin/python -c \
    'import mpi4py; print(mpi4py.__version__)')" -d . 2>/dev/null || echo "device_bundle: no mpi4py source" >&2
du -sh . | sed 's/^/device_bundle: .devbundle holds /'
