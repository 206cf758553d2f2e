"""Adasum: the adaptive summation of Maleki et al., "Scaling Distributed Training with
Adaptive Summation" (MLSys 2021), with Horovod's semantics.

Two gradients a and b of one tensor combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its vector is zero, so adasum(0, b) = b): orthogonal
gradients add up, equal ones are kept once, so the result stays about the size
of one rank's gradient whatever the number of ranks. The ranks combine in a
binary tree: pairs at distance 1 (0+1, 2+3, ...), then their results at
distance 2, 4, ..., so the number of ranks must be a power of two (as
Horovod's CPU Adasum requires; a tree with a missing leaf would weigh some
ranks' gradients more than others', which is not Adasum any more).

Per tensor, as Horovod: the dot products are taken over each parameter of the
bucket plan separately (its slot of the flat buffer), never over a whole
bucket, so fusing tensors into buckets does not change the result.

Adasum is not a weighted mean: sample counts cannot weigh it, so a reducer
with op=adasum refuses any weight but 1 (``set_weight``), and there is no
division by the number of ranks.

This module holds what every path shares (the rank-count rule, the
coefficients, the per-tensor segments, the combination of one pair on this
process) and the recursive doubling over MPI of mode ``allreduce`` and of
``eddis.allreduce(op=Adasum)``. Mode ``sync`` runs the same tree on the SMB
servers (``eddis.core.reduce.adasum_sync``).
"""
import numpy as np

from ...errors import ConfigError
from .waits import start, wait_request

try:  # the C kernels (fp32 accumulation, bit-identical on every path); numpy otherwise
    from ...smb import _vecops
except ImportError:  # pragma: no cover - depends on the build
    _vecops = None

ONE_WEIGHT_ONLY = ("Adasum combines the ranks' gradients by their directions, not as a weighted mean, "
                   "so sample counts cannot weigh it: drop set_sample_count / sample_count= / "
                   "balance=True, or use op=Average")


def check_ranks(size, what):
    """ConfigError unless ``size`` ranks can form Adasum's binary tree (a power of two)."""
    size = int(size)
    if size < 1 or size & (size - 1):
        below = 1 << (size.bit_length() - 1) if size > 0 else 1
        raise ConfigError(f"{what}: Adasum combines the ranks in a binary tree and needs a power-of-2 "
                          f"number of ranks, not {size}; launch {below} or {below * 2} ranks, or use "
                          "op=Average")


def check_weight(weight):
    if float(weight) != 1.0:
        raise ConfigError(f"sample count {weight:g} with op=Adasum: {ONE_WEIGHT_ONLY}")


def pair_weights(dots):
    """The coefficients (w_a, w_b) per tensor, from its (a.b, a.a, b.b): an (n, 2) float64 array."""
    dots = np.asarray(dots, dtype=np.float64).reshape(-1, 3)
    ab, aa, bb = dots[:, 0], dots[:, 1], dots[:, 2]
    weights = np.ones((len(dots), 2), dtype=np.float64)
    for column, norm in ((0, aa), (1, bb)):
        ratio = np.zeros(len(dots))
        np.divide(ab, 2.0 * norm, out=ratio, where=norm != 0)
        weights[:, column] -= ratio
    return weights


def bucket_segments(plan, k):
    """(start, count) of every tensor of bucket ``k``, in flat-buffer columns."""
    return [(plan.slots[i].start, plan.slots[i].count) for i in plan.buckets[k].params]


def dot_norms(a, b):
    """(a.b, a.a, b.b) of two 1-D arrays: the C kernel on fp32/fp16 arrays, else float64 numpy."""
    if _vecops is not None and a.dtype in (np.float32, np.float16) and b.dtype in (np.float32, np.float16):
        return _vecops.dot_norms(a, b)
    wa, wb = a.astype(np.float64), b.astype(np.float64)
    return float(wa @ wb), float(wa @ wa), float(wb @ wb)


def combine(a, b, segments, out):
    """out = adasum(a, b) per segment (start, count) of the arrays (``out`` may be ``a`` or
    ``b``). fp32 arrays combine in fp32 with the C kernels, others in their own dtype."""
    dots = np.array([dot_norms(a[s:s + n], b[s:s + n]) for s, n in segments]).reshape(-1, 3)
    weights = pair_weights(dots)
    native = _vecops is not None and a.dtype == b.dtype == out.dtype == np.float32
    for (start, count), (wa, wb) in zip(segments, weights):
        piece = slice(start, start + count)
        if native:
            _vecops.weighted_sum(out[piece], [a[piece], b[piece]], [wa, wb])
        else:
            out[piece] = wa * a[piece] + wb * b[piece]
    return out


def tree_levels(size):
    """The distances of the tree's levels: 1, 2, 4, ... below ``size``."""
    distance = 1
    while distance < size:
        yield distance
        distance *= 2


class PairwiseExchange:
    """Recursive doubling over an MPI communicator: at distance d = 1, 2, 4, ... each
    rank swaps its current vector with rank ^ d and both compute adasum(lower rank's,
    higher rank's) from the very same inputs, so after log2(size) levels every rank
    holds the same bits. With a codec, what travels is the wire dtype, and each rank
    rounds its own vector the same way before combining, so both sides still agree;
    the dot products and the combination run in fp32."""

    def __init__(self, comm, codec, timeout, what, length):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.codec = codec
        self.timeout = timeout
        self.what = what
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        check_ranks(self.size, what)
        self._theirs = np.empty(length, dtype=np.float32)
        self._wire_mine = None if codec.is_identity else codec.empty(length)
        self._wire_theirs = None if codec.is_identity else codec.empty(length)

    def _message(self, array):
        """[buffer, MPI datatype]: MPI has no half-precision type, fp16/bf16 travel as 16-bit words."""
        if array.dtype == np.float32:
            return [array, self.MPI.FLOAT]
        return [array.view(np.uint16), self.MPI.UINT16_T]

    def reduce(self, vector, segments, tag=0, offset=0):
        """Replace ``vector`` (fp32) by the Adasum of every rank's; ``segments`` relative to it.
        ``offset``: where ``vector`` starts in this exchange's scratch (the bucket's start)."""
        count = vector.size
        theirs = self._theirs[offset:offset + count]
        for distance in tree_levels(self.size):
            partner = self.rank ^ distance
            if self.codec.is_identity:
                send, recv = vector, theirs
            else:
                send = self.codec.compress(vector, out=self._wire_mine[offset:offset + count])
                recv = self._wire_theirs[offset:offset + count]
                self.codec.decompress(send, vector)  # round own values as the partner sees them
            recv_req = start(self.comm.Irecv, self._message(recv), source=partner, tag=tag)
            send_req = start(self.comm.Isend, self._message(send), dest=partner, tag=tag)
            what = f"{self.what} (Adasum with rank {partner} at distance {distance})"
            wait_request(send_req, self.timeout, what)
            wait_request(recv_req, self.timeout, what)
            if not self.codec.is_identity:
                self.codec.decompress(recv, theirs)
            lower, upper = (vector, theirs) if self.rank < partner else (theirs, vector)
            combine(lower, upper, segments, out=vector)
        return vector


def allreduce_array(array, comm, timeout, what):
    """``eddis.allreduce(op=Adasum)`` of a float array (float64 here): the whole tensor is one
    segment; a new array, the same on every rank."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    check_ranks(size, what)
    mine = np.array(array, dtype=np.float64).reshape(-1)
    theirs = np.empty_like(mine)
    for distance in tree_levels(size):
        partner = rank ^ distance
        recv_req = start(comm.Irecv, [theirs, MPI.DOUBLE], source=partner, tag=1)
        send_req = start(comm.Isend, [mine, MPI.DOUBLE], dest=partner, tag=1)
        wait_request(send_req, timeout, what)
        wait_request(recv_req, timeout, what)
        lower, upper = (mine, theirs) if rank < partner else (theirs, mine)
        mine = combine(lower, upper, [(0, mine.size)], out=np.empty_like(mine))
    return mine.reshape(np.shape(array))
