# Spack recipe for EDDIS. Use it from a checkout:
#   spack repo add <checkout>/spack
#   spack install py-eddis@main +verbs +torch ^openmpi fabrics=ucx ^ucx+verbs
# The variants mirror setup.py's build switches one to one (EDDIS_WITH_<X> /
# EDDIS_WITHOUT_<X>); UCX and MPI are always required.
import os

from spack.package import *

# This recipe ships inside the EDDIS source tree (spack/packages/py-eddis/), so the
# default source is that checkout; a site mirror can override `git`.
_CHECKOUT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


class PyEddis(PythonPackage):
    """EDDIS: data-parallel training of PyTorch and TensorFlow models across Slurm
    GPU nodes of different generations over SMB (Soft Memory Box), a pool of node
    memory reached through UCX (InfiniBand verbs, shared memory or TCP)."""

    homepage = "file://" + _CHECKOUT
    git = "file://" + _CHECKOUT

    maintainers("eddis-dev")
    license("Apache-2.0")

    version("main", branch="main")

    variant("verbs", default=True, description="InfiniBand device query and UCX over verbs (libibverbs)")
    variant("cuda", default=False, description="CUDA support (GPU buffers in UCX, CUDA runtime)")
    variant("torch", default=True, description="PyTorch adapter (eddis.torch)")
    variant("tensorflow", default=False, description="TensorFlow/Keras adapter (eddis.tensorflow)")

    conflicts("~torch~tensorflow", msg="EDDIS trains PyTorch or TensorFlow models: enable +torch or +tensorflow")

    depends_on("python@3.9:", type=("build", "run"))
    depends_on("py-setuptools@64:", type="build")
    depends_on("py-wheel", type="build")
    depends_on("py-cython@3:", type="build")
    depends_on("py-numpy", type=("build", "run"))
    depends_on("py-mpi4py@4:", type=("build", "run"))
    depends_on("py-h5py", type="run")
    depends_on("py-tqdm", type="run")
    depends_on("py-matplotlib", type="run")
    depends_on("py-pytest", type="test")

    depends_on("mpi")
    depends_on("ucx")
    depends_on("ucx+verbs", when="+verbs")
    depends_on("rdma-core", when="+verbs")
    depends_on("ucx+cuda", when="+cuda")
    depends_on("cuda", when="+cuda")
    depends_on("py-torch", type=("build", "run"), when="+torch")
    depends_on("py-torch+cuda", type=("build", "run"), when="+torch+cuda")
    depends_on("py-tensorflow", type=("build", "run"), when="+tensorflow")

    # Build switch of setup.py -> the variant that drives it (None: always on).
    SWITCHES = {"UCX": None, "MPI": None, "VERBS": "verbs", "CUDA": "cuda"}

    def setup_build_environment(self, env):
        spec = self.spec
        for switch, variant_name in self.SWITCHES.items():
            wanted = variant_name is None or spec.satisfies("+" + variant_name)
            env.set(("EDDIS_WITH_" if wanted else "EDDIS_WITHOUT_") + switch, "1")
        env.set("MPICC", spec["mpi"].mpicc)
        if spec.satisfies("+cuda"):
            env.set("CUDA_HOME", spec["cuda"].prefix)

    def setup_run_environment(self, env):
        env.set("EDDIS_HOME", self.prefix)

    @run_after("install")
    def eddis_doctor(self):
        """The installed `eddis doctor` must find UCX, MPI and a framework."""
        doctor = Executable(join_path(self.prefix.bin, "eddis"))
        report = doctor("doctor", "--json", output=str)
        mkdirp(join_path(self.prefix.share, "eddis"))
        with open(join_path(self.prefix.share, "eddis", "doctor-at-install.json"), "w") as f:
            f.write(report)
