# cython: language_level=3
"""MPI helpers over mpi4py's communicators (extension ``eddis._mpi``).

- ``library_version()``: the MPI library's own version string
  (``MPI_Get_library_version``), for ``eddis doctor``.
- ``allreduce_sum_inplace(comm, buf)``: in-place sum-allreduce of a
  C-contiguous, writable float32/float64 buffer on an ``mpi4py.MPI.Comm``,
  with the GIL released for the whole call (the runtime's ``mpi`` baseline runs
  it on a background thread while the main thread keeps computing).

Every MPI call goes through ``CHKERR``; a failure raises :class:`MPIError`
(an :class:`eddis.errors.EddisError` and a ``RuntimeError``) with the MPI
error code and its ``MPI_Error_string``.
"""
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE,
                             PyBUF_C_CONTIGUOUS, PyBUF_FORMAT)
from libc.limits cimport INT_MAX

from mpi4py.libmpi cimport *
from mpi4py cimport MPI

# MPIError: also importable from here (eddis._mpi.MPIError), its old address
from eddis.errors import ConfigError, MPIError


cdef str _error_string(int code):
    cdef char text[MPI_MAX_ERROR_STRING + 1]
    cdef int length = 0
    if MPI_Error_string(code, text, &length) != MPI_SUCCESS:
        return f"MPI error {code}"
    return text[:length].decode("utf-8", "replace")


cdef int CHKERR(int code, const char *what) except -1 nogil:
    if code == MPI_SUCCESS:
        return 0
    with gil:
        raise MPIError(f"{what.decode()} failed: {_error_string(code)}", code)


def library_version():
    """``MPI_Get_library_version``: e.g. 'Open MPI v4.1.4, package: ...'."""
    cdef char text[MPI_MAX_LIBRARY_VERSION_STRING + 1]
    cdef int length = 0
    with nogil:
        CHKERR(MPI_Get_library_version(text, &length), "MPI_Get_library_version")
    # Open MPI counts the terminating NUL in length.
    return text[:length].decode("utf-8", "replace").split("\0")[0].strip()


def standard_version():
    """``MPI_Get_version`` as (major, minor)."""
    cdef int major = 0, minor = 0
    with nogil:
        CHKERR(MPI_Get_version(&major, &minor), "MPI_Get_version")
    return major, minor


def allreduce_sum_inplace(MPI.Comm comm not None, object buf):
    """Sum ``buf`` over all ranks of ``comm`` in place (MPI_IN_PLACE, MPI_SUM).

    ``buf``: a writable C-contiguous float32 or float64 buffer (numpy array,
    CPU torch tensor via ``.numpy()``, memoryview). Every rank must pass the
    same element count and dtype. Buffers of more than INT_MAX elements go in
    INT_MAX-sized pieces (MPI-3 counts are ``int``).
    """
    cdef Py_buffer view
    cdef MPI_Datatype dtype
    cdef MPI_Comm c_comm = comm.ob_mpi
    cdef Py_ssize_t count, done = 0, piece, itemsize
    cdef char *data
    if c_comm == MPI_COMM_NULL:
        raise ConfigError("allreduce_sum_inplace: the communicator is MPI.COMM_NULL; pass a valid communicator")
    try:
        PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except (BufferError, TypeError, ValueError) as exc:
        raise ConfigError(f"allreduce_sum_inplace needs a writable C-contiguous float32/float64 buffer: {exc}") from None
    try:
        fmt = (view.format or b"B").lstrip(b"@=<")
        if fmt == b"f" and view.itemsize == 4:
            dtype = MPI_FLOAT
        elif fmt == b"d" and view.itemsize == 8:
            dtype = MPI_DOUBLE
        else:
            raise ConfigError(f"allreduce_sum_inplace supports float32 and float64 buffers, "
                              f"not format {fmt.decode()!r}; convert with .astype('float32')")
        itemsize = view.itemsize
        count = view.len // itemsize
        data = <char *>view.buf
        with nogil:
            while done < count:
                piece = min(count - done, <Py_ssize_t>INT_MAX)
                CHKERR(MPI_Allreduce(MPI_IN_PLACE, data + done * itemsize, <int>piece,
                                     dtype, MPI_SUM, c_comm), "MPI_Allreduce")
                done += piece
    finally:
        PyBuffer_Release(&view)
