-- -*- lua -*-
-- Lmod modulefile for EDDIS 0.1.0 (Tcl twin for Environment Modules: modulefiles/tcl/eddis/0.1.0).
--
-- Site install: replace @EDDIS_PREFIX@ with the installation prefix (a virtual
-- environment holding eddis, e.g. /opt/eddis/0.1.0), see docs/install.md.
-- Left as is, the prefix is the source checkout this file sits in (its .venv).

local version = "0.1.0"
local prefix = "@EDDIS_PREFIX@"
if prefix:sub(1, 1) == "@" then
    -- <checkout>/modulefiles/eddis/0.1.0.lua -> <checkout>
    prefix = myFileName():gsub("/modulefiles/eddis/[^/]+$", "")
end

whatis("Name: eddis")
whatis("Version: " .. version)
whatis("Category: library, machine learning, distributed training")
whatis("Description: Distributed PyTorch/TensorFlow training over SMB (Soft Memory Box) shared memory on Slurm clusters with heterogeneous GPUs")
whatis("URL: docs/README.md in the EDDIS source")

help([[
EDDIS ]] .. version .. [[ - data-parallel training of PyTorch and TensorFlow models across
GPU nodes of different generations (e.g. A100 + V100) over SMB, a pool of node memory
reached by RDMA (UCX over InfiniBand, TCP elsewhere).

Commands this module provides:
  eddis doctor          check UCX, InfiniBand, MPI, Slurm, GPUs and frameworks
  eddis settings        list every EDDIS_/SMB_ setting
  eddis-train train.py  the per-rank launcher (inside a job: srun --mpi=pmix eddis-train train.py)
  smb-server            the SMB memory server (started by the job script)

Typical use:
  module load eddis
  cp $EDDIS_HOME/scripts/eddis_job.sh . && sbatch eddis_job.sh

Environment: EDDIS_HOME is the installation prefix. MPI jobs use srun --mpi=pmix.
Documentation: $EDDIS_HOME/docs (user-guide.md, install.md).
]])

-- A Spack-generated module of the same package would put a second eddis on PATH.
conflict("py-eddis")

-- The checkout keeps its Python environment in .venv; a site prefix is the venv itself.
local venv = prefix .. "/.venv"
if not isDir(venv .. "/bin") then
    venv = prefix
end

setenv("EDDIS_HOME", prefix)
prepend_path("PATH", venv .. "/bin")
if isDir(prefix .. "/src/eddis") then
    prepend_path("PYTHONPATH", prefix .. "/src")
end
if isDir(prefix .. "/scripts") then
    prepend_path("PATH", prefix .. "/scripts")
end
