#!/bin/bash
# What bench/device_check.sh needs on a GPU machine that has PyTorch but neither UCX
# nor Open MPI (the lent H200 has no package registry): Debian's packages, downloaded
# here into .devbundle/ (ignored by git; name it in the device run's carry), and mpi4py:
# built here for the GPU machine's Python where this machine has that Python, else built
# there from the carried source, against the carried MPI either way.
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
# the GPU machine's Python is 3.12: mpi4py built here for it, against this same Open MPI,
# spares the check minutes of device time (DEVICE_PYTHON names another interpreter)
py=${DEVICE_PYTHON:-$(command -v python3.12 || ls "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3 2>/dev/null | tail -n 1)}
if [ -n "$py" ] && compgen -G "mpi4py-*.tar.gz" >/dev/null; then
    version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    rm -rf "site-py$version"
    "$py" -m pip install -q --no-deps --target "site-py$version" mpi4py-*.tar.gz \
        && echo "device_bundle: mpi4py built for Python $version into .devbundle/site-py$version"
else
    echo "device_bundle: no Python 3.12 here: the check builds mpi4py on the GPU machine (about a minute)" >&2
fi
du -sh . | sed 's/^/device_bundle: .devbundle holds /'
