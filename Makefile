# The two commands of the README:
#   make test   set everything up on Debian 12 (apt packages, .venv, build, local Slurm) and run the tests
#   make demo   same set-up, then submit the example training job to the local Slurm cluster and show its output
# Every set-up step is idempotent and quick when already done (stamp files under .eddis-dev/).

SHELL        := /bin/bash
.SHELLFLAGS  := -eu -o pipefail -c
REPO         := $(CURDIR)
VENV         := $(REPO)/.venv
PY           := $(VENV)/bin/python
PIP          := $(PY) -m pip
STAMPS       := $(REPO)/.eddis-dev
SYSTEM_PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS  ?=
# pytest-xdist workers for make test (0: one process). Most of the suite waits on Slurm,
# timeouts and subprocesses, so two workers pay even on two cores; the tests that share the
# dev cluster or the hugetlb pages run one after another in their xdist group (tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ "$$n" -gt 4 ] && n=4; [ "$$n" -lt 2 ] && n=2; echo $$n)
export EDDIS_DEV_CLUSTER_DIR ?= /tmp/eddis-dev-cluster
SLURM_CONF_DEV := $(EDDIS_DEV_CLUSTER_DIR)/slurm.conf
DEMO_SCRIPT  ?= examples/torch_train.py
DEMO_OUT     ?= $(STAMPS)/demo-%j.out

APT_PACKAGES := build-essential pkg-config python3-dev python3-venv \
	slurm-wlm munge libpmix2 openmpi-bin libopenmpi-dev \
	libucx-dev ucx-utils libibverbs-dev librdmacm-dev rdma-core ibverbs-utils lmod \
	iproute2
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
NATIVE_SOURCES := setup.py setup.cfg $(wildcard cython/*.pyx cython/*.pxi cython/*.pxd cython/*.h)

.PHONY: test test-unit demo setup system-packages cluster cluster-down build clean-build help hugepages

help:
	@echo "make test   set up (apt, .venv, build, local Slurm cluster) and run the test suite"
	@echo "make test-unit   the quick tier: single-process tests only (no Slurm, MPI, GPU)"
	@echo "make demo   set up, then sbatch the example training job on the local cluster"
	@echo "make cluster / cluster-down   start / stop the local Slurm cluster"

setup: system-packages $(STAMPS)/editable.stamp cluster

# apt: only what is missing (dpkg-query is instant when all is there).
system-packages:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(PY):
	$(SYSTEM_PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Python packages: torch pinned; mpi4py compiled against the system MPI so the
# MPI extension and mpi4py share one libmpi.
$(STAMPS)/pip.stamp: requirements-dev.txt | $(PY)
	@mkdir -p $(STAMPS)
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PY) -c "import importlib.metadata as m, sys; sys.exit('manylinux' in m.distribution('mpi4py').read_text('WHEEL'))" 2>/dev/null || \
	  MPICC=mpicc $(PIP) install -q --force-reinstall --no-deps --no-binary=mpi4py --no-build-isolation "mpi4py>=4"
	$(PIP) install -q tensorflow-cpu
	touch $@

# Native extensions in place (src/eddis/*.so), rebuilt when a Cython source changes. UCX and
# MPI are required here (system-packages installs them): an auto-detected build that missed
# one would turn whole suites into skips.
$(STAMPS)/build.stamp: $(NATIVE_SOURCES) $(STAMPS)/pip.stamp
	EDDIS_WITH_UCX=1 EDDIS_WITH_MPI=1 $(PY) setup.py -q build_ext --inplace
	touch $@

# The console scripts (eddis, eddis-train, smb-server) in .venv/bin: an editable
# install, redone only when the metadata (entry points) changes.
$(STAMPS)/editable.stamp: setup.cfg $(STAMPS)/build.stamp
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

build: system-packages $(STAMPS)/editable.stamp

# Network mode: EDDIS_DEV_CLUSTER_NET=auto (netns where the machine allows it; CI's does),
# netns or loopback; EDDIS_DEV_CLUSTER_LINK and EDDIS_DEV_CLUSTER_NODES pass through too.
DEV_CLUSTER_ENV = EDDIS_DEV_CLUSTER_DIR=$(EDDIS_DEV_CLUSTER_DIR) EDDIS_DEV_CLUSTER_NET="$${EDDIS_DEV_CLUSTER_NET:-}" \
	EDDIS_DEV_CLUSTER_LINK="$${EDDIS_DEV_CLUSTER_LINK:-}" EDDIS_DEV_CLUSTER_NODES="$${EDDIS_DEV_CLUSTER_NODES:-}"

cluster: system-packages
	$(SUDO) env $(DEV_CLUSTER_ENV) scripts/eddis-dev-cluster up

cluster-down:
	$(SUDO) env EDDIS_DEV_CLUSTER_DIR=$(EDDIS_DEV_CLUSTER_DIR) scripts/eddis-dev-cluster down

# A few explicit huge pages (32 MiB), so the tests cover smb-server's hugetlb arena
# (UCX's own SysV segments take some too where they are free); where the kernel
# refuses, those tests are skipped and say why.
hugepages:
	@[ -w /proc/sys/vm/nr_hugepages ] || [ -n "$(SUDO)" ] || exit 0; \
	free=$$(awk '/^HugePages_Free/ {print $$2}' /proc/meminfo); total=$$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0); \
	if [ "$${free:-0}" -lt 16 ]; then \
	  $(SUDO) sh -c "echo $$((total + 16 - $${free:-0})) > /proc/sys/vm/nr_hugepages" 2>/dev/null || true; \
	  echo "hugetlb pages free for the tests: $$(awk '/^HugePages_Free/ {print $$2}' /proc/meminfo)"; \
	fi

# The 25 slowest tests are listed at the end, so that a CI log shows where the
# suite's time goes (keep it well under 30 minutes).
# make turns every failing status into 2; pytest's own status is kept in
# .eddis-dev/pytest.rc so .ci/run can tell "no tests collected" (5) from failures.
test: setup hugepages
	@rm -f $(STAMPS)/pytest.rc
	cd $(REPO) && OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25 $(PYTEST_ARGS) || { rc=$$?; echo $$rc > $(STAMPS)/pytest.rc; exit $$rc; }

# The quick tier for the edit-test loop: pure functions and single-process tests (no
# Slurm, no MPI ranks, no netns cluster, no GPU, nothing slow); make test runs everything.
test-unit: build
	cd $(REPO) && OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slurm and not mpi and not netns and not gpu and not slow" $(PYTEST_ARGS)

demo: setup
	@for f in scripts/eddis_job.sh $(DEMO_SCRIPT); do \
	  [ -f "$$f" ] || { echo "make demo: $$f is missing (it comes with the launcher/runtime issues)"; exit 1; }; \
	done
	@mkdir -p $(STAMPS)
	@echo "sbatch --wait scripts/eddis_job.sh $(DEMO_SCRIPT)   (SLURM_CONF=$(SLURM_CONF_DEV))"
	@echo "local cluster: $$(sed -n 's/^NET=/network mode /p; s/^NODES=\(.*\)/\1 nodes/p; s/^LINK=/link /p' \
	  $(EDDIS_DEV_CLUSTER_DIR)/cluster.env 2>/dev/null | paste -sd, | sed 's/,/, /g')"
	@set +e; \
	out=$$(PATH=$(VENV)/bin:$$PATH SLURM_CONF=$(SLURM_CONF_DEV) PYTHONPATH=$(REPO)/src \
	  sbatch --parsable --wait --output=$(DEMO_OUT) scripts/eddis_job.sh $(DEMO_SCRIPT)); rc=$$?; \
	job=$${out%%;*}; job=$${job##*$$'\n'}; \
	file=$$(echo "$(DEMO_OUT)" | sed "s/%j/$$job/"); \
	echo "---- job $$job output ($$file) ----"; cat "$$file" 2>/dev/null || echo "(no output file)"; \
	echo "---- job $$job exit status $$rc ----"; exit $$rc

clean-build:
	rm -rf build $(STAMPS)/build.stamp src/eddis/*.so src/eddis/*/*.so cython/*.c
