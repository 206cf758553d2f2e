"""EDDIS: data-parallel training of PyTorch and TensorFlow models over SMB shared memory."""
__version__ = "0.1.0"
