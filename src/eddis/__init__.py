"""EDDIS: data-parallel training of PyTorch and TensorFlow models over SMB shared memory."""
__version__ = "0.1.0"

from .timeline import start_timeline, stop_timeline  # noqa: E402,F401  (light: no numpy, h5py or MPI)
