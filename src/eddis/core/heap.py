"""The trainer's C heap: keep freed memory for the next step (``EDDIS_KEEP_FREED_MEMORY``).

A framework that allocates each step's gradients and activations anew (PyTorch after
``zero_grad()``, which sets ``.grad`` to None) asks the C heap for the same large blocks
every step. glibc serves a block of 32 MiB or more (and, by default, of 128 KiB or more
until it has seen one freed) with a fresh ``mmap`` and returns it at ``free``: every step
then faults in and zeroes each page of it again, in the kernel, on the cores the training
shares with the communication. Told to serve large blocks from its heap and to keep what is
freed there, glibc hands the next step the pages the last one faulted in. The heap then
holds on to its peak, as a caching allocator does; the memory stays the process's and
counts in its RSS.
"""
import ctypes
import logging

log = logging.getLogger("eddis.core.heap")

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# the most mallopt takes (an int): free memory at the heap's top is returned above this
KEEP_AT_TOP = (1 << 31) - 1


def _glibc():
    """The C library's handle when it is glibc (mallopt's parameters are glibc's), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory():
    """Serve large blocks from the heap and keep what is freed there (module docstring).
    True when the C heap took it; False (logged) where the C library is not glibc, whose
    allocator keeps its own policy, or mallopt refused."""
    libc = _glibc()
    if libc is None:
        log.info("C heap left as is: the C library is not glibc")
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_AT_TOP)):
        log.warning("C heap left as is: glibc's mallopt refused M_MMAP_MAX=0 or M_TRIM_THRESHOLD")
        return False
    log.info("C heap: large blocks from the heap, freed memory kept for the next step")
    return True
