"""EDDIS: data-parallel training of PyTorch and TensorFlow models over SMB shared memory."""
__version__ = "0.1.0"  # the one place: setup.cfg reads it (attr:)

# The package's root imports nothing, so that importing any layer (eddis.smb, ...)
# loads only that layer and the ones below it (tests/test_layers.py).
_LAZY = {"start_timeline": "eddis.timeline", "stop_timeline": "eddis.timeline"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'eddis' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
