# Spack recipe for EDDIS, shipped in the EDDIS source tree. Use it from a checkout:
#
#   spack repo add <checkout>/spack
#   spack install py-eddis@0.1.0 +verbs +torch ^openmpi schedulers=slurm
#
# docs/install.md ("With Spack") has the packages.yaml for externals, how a site
# points the recipe at its own copy of the sources, and the commands to check it.
# The variants mirror setup.py's build switches one to one (EDDIS_WITH_<X> /
# EDDIS_WITHOUT_<X>); UCX and MPI are always required.
import os

from spack.package import *

# The recipe lives in the source tree (spack/packages/py-eddis/), so the default
# source is the git repository it sits in; a site sets its own copy in
# packages.yaml (package_attributes: git: ...), see docs/install.md.
_CHECKOUT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


class PyEddis(PythonPackage, CudaPackage):
    """EDDIS: data-parallel training of PyTorch and TensorFlow models across Slurm
    GPU nodes of different generations over SMB (Soft Memory Box), a pool of node
    memory reached through UCX (InfiniBand verbs, shared memory or TCP)."""

    homepage = "file://" + _CHECKOUT
    git = "file://" + _CHECKOUT

    license("Apache-2.0")

    # Releases are git tags v<version> (src/eddis/__init__.py: __version__).
    version("main", branch="main")
    version("0.1.0", tag="v0.1.0", preferred=True)

    variant(
        "verbs",
        default=True,
        description="InfiniBand device query and UCX over verbs (libibverbs)",
    )
    variant(
        "mlx5",
        default=False,
        when="+verbs",
        description="UCX with the Mellanox/NVIDIA HCA transports (DC, mlx5 DV, RDMA CM)",
    )
    variant("torch", default=True, description="PyTorch adapter (eddis.torch)")
    variant("tensorflow", default=False, description="TensorFlow/Keras adapter (eddis.tensorflow)")

    conflicts(
        "~torch~tensorflow",
        msg="EDDIS trains PyTorch or TensorFlow models: enable +torch or +tensorflow",
    )
    conflicts(
        "cuda_arch=none",
        when="+cuda",
        msg="+cuda needs the GPUs' compute capabilities, e.g. cuda_arch=80 or 90",
    )

    # The Cython extensions are C: the compiler dependency makes Spack's wrapper
    # link them (with RPATHs to UCX and MPI); setup.py finds UCX and verbs through
    # pkg-config.
    depends_on("c", type="build")
    depends_on("pkgconfig", type="build")

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
    depends_on("py-pytest-timeout", type="test")
    depends_on("py-scikit-learn", type="test")

    depends_on("mpi")
    # Open MPI builds without UCX unless asked (fabrics=none by default).
    depends_on("openmpi fabrics=ucx", when="^[virtuals=mpi] openmpi")
    # The SMB client's UCP worker is UCS_THREAD_MODE_MULTI (cython/smb_client.pxi).
    depends_on("ucx+thread_multiple")
    # ucx+verbs alone has no InfiniBand transport: RC and UD are separate variants.
    depends_on("ucx+verbs+rc+ud", when="+verbs")
    depends_on("ucx+dc+mlx5_dv+rdmacm", when="+mlx5")
    depends_on("rdma-core", when="+verbs")
    depends_on("ucx+cuda", when="+cuda")
    depends_on("py-torch@2:", type="run", when="+torch")
    depends_on("py-tensorflow@2.15:", type="run", when="+tensorflow")
    # py-torch+cuda needs the same compute capabilities as EDDIS's CUDA build.
    for _arch in CudaPackage.cuda_arch_values:
        depends_on(
            f"py-torch+cuda cuda_arch={_arch}", type="run", when=f"+torch+cuda cuda_arch={_arch}"
        )

    # Build switch of setup.py -> the variant that drives it (None: always on).
    SWITCHES = {"UCX": None, "MPI": None, "VERBS": "verbs", "CUDA": "cuda"}

    def setup_build_environment(self, env):
        spec = self.spec
        for switch, variant_name in self.SWITCHES.items():
            wanted = variant_name is None or spec.satisfies("+" + variant_name)
            prefix = "EDDIS_WITH_" if wanted else "EDDIS_WITHOUT_"
            env.set(prefix + switch, "1")
        env.set("MPICC", spec["mpi"].mpicc)
        # the UCX this spec depends on, not whatever pkg-config finds first
        env.set("EDDIS_UCX_HOME", spec["ucx"].prefix)
        if spec.satisfies("+cuda"):
            env.set("CUDA_HOME", spec["cuda"].prefix)

    def setup_run_environment(self, env):
        env.set("EDDIS_HOME", self.prefix)

    # What `spack test run` imports: the packages, and the extensions (which load UCX, MPI
    # and libibverbs through their RPATHs). Listed, since Spack looks for modules under
    # python's purelib, which for Debian's system Python (local/lib/python3.11/
    # dist-packages) is not where the package is (lib/python3.11/site-packages).
    PACKAGES = [
        "eddis",
        "eddis.core",
        "eddis.core.checkpoint",
        "eddis.core.comm",
        "eddis.core.hetero",
        "eddis.core.layout",
        "eddis.core.progress",
        "eddis.core.reduce",
        "eddis.launch",
        "eddis.plan",
        "eddis.slurm",
        "eddis.smb",
        "eddis.tensorflow",
        "eddis.tensorflow.keras",
        "eddis.timeline",
        "eddis.torch",
    ]
    EXTENSIONS = {
        "eddis.smb._core": None,
        "eddis.smb._vecops": None,
        "eddis._mpi": None,
        "eddis._verbs": "verbs",
    }

    @property
    def import_modules(self):
        modules = list(self.PACKAGES)
        for name, variant_name in self.EXTENSIONS.items():
            if variant_name is None or self.spec.satisfies("+" + variant_name):
                modules.append(name)
        skipped = self.skip_modules
        return [m for m in modules if not any(m == s or m.startswith(s + ".") for s in skipped)]

    @property
    def skip_modules(self):
        """Adapters that are switched off are not imported by `spack test run`."""
        skipped = []
        if self.spec.satisfies("~torch"):
            skipped.append("eddis.torch")
        if self.spec.satisfies("~tensorflow"):
            skipped.append("eddis.tensorflow")
        return skipped

    def test_doctor(self):
        """run the installed `eddis doctor --json` (UCX, MPI, a framework)"""
        eddis = which(self.prefix.bin.eddis)
        report = eddis("doctor", "--json", output=str, error=str)
        print(report)
