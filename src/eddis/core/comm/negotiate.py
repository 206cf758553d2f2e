"""What a script's collective announces before it runs, and what every rank concludes.

Before a collective the script called moves any data (``eddis.allreduce``, ``allgather``,
``broadcast``, their ``*_async`` forms, ``broadcast_object``, ``allgather_object``,
``barrier``, the broadcasts of parameters and variables), each rank announces it: a
:class:`Call` (kind, name, dtype, shape, root, op, ...) in a fixed-size slot, gathered
from every rank (:mod:`eddis.core.comm.engine`). A rank inside ``join()`` announces
``joined`` instead. From the same list every rank draws the same :class:`Outcome` with
:func:`decide`: run the collective, a joined rank taking its part, or refuse it with one
error on every rank that called it. So a collective is never run by some ranks and refused
by others, and calls that do not match (another kind, dtype, shape, root, op) fail with
an error naming both sides instead of mixing data or crashing MPI.

Beside a joined rank, as Horovod decides it (``Controller::ConstructResponse``):

- ``allreduce`` runs, the joined rank contributing zeros, so ``Sum`` is the sum over the
  ranks with data and ``Average`` that sum divided by all ranks; with ``Min``/``Max`` it
  contributes the op's identity (Horovod's zeros would win a max of negative numbers),
  so they are the min/max over the ranks with data; ``Adasum`` of a zero vector is the
  other vector;
- ``barrier`` runs;
- everything that moves a particular rank's data (allgather, broadcast, the object
  collectives, the parameter broadcasts) is refused on the ranks that called it with a
  :class:`UsageError`, as Horovod refuses allgather, broadcast, alltoall and
  reducescatter; the joined ranks go on waiting in ``join()``.
"""
import dataclasses
import math
import pickle
import struct

import numpy as np

from ...errors import ConfigError, UsageError
from . import adasum

SLOT = 256           # bytes of one rank's announcement: every rank receives size * SLOT per call
NAME_CHARS = 64      # a longer name is cut (names are compared, never used as keys)
MESSAGE_CHARS = 120  # an invalid call's reason, cut so that it fits the slot with any name

JOINED = "joined"
INVALID = "invalid"
DATA_KINDS = ("allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object", "barrier")
SERVED_BESIDE_JOIN = ("allreduce", "barrier")

_FIELDS = ("kind", "name", "dtype", "wire", "shape", "root", "op", "factors", "nbytes", "key", "message")


@dataclasses.dataclass(frozen=True)
class Call:
    """One rank's announcement. Kinds other than :data:`DATA_KINDS`, ``joined`` and
    ``invalid`` announce a composite call (``broadcast_parameters``...) that moves its data
    itself once every rank agreed (``root`` is compared)."""

    kind: str
    name: str = None
    dtype: str = None      # the caller's dtype name: float32, bfloat16, int64
    wire: str = None       # numpy dtype string of what travels ('<f8' for a float allreduce)
    shape: tuple = None
    root: int = None
    op: str = None         # allreduce: sum, average, min, max, adasum
    factors: tuple = None  # allreduce: (prescale, postscale)
    nbytes: int = None     # object collectives: this rank's pickled size
    key: tuple = None      # joined: the join key (eddis.core.progress.join)
    message: str = None    # invalid: why this rank cannot describe its call

    def __post_init__(self):
        if self.name is not None:
            object.__setattr__(self, "name", str(self.name)[:NAME_CHARS])
        if self.message is not None:
            object.__setattr__(self, "message", str(self.message)[:MESSAGE_CHARS])
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def what(self):
        return f"eddis.{self.kind}({self.name or ''})"

    @property
    def count(self):
        return math.prod(self.shape or ())

    def encode(self):
        body = pickle.dumps(tuple(getattr(self, f) for f in _FIELDS), protocol=pickle.HIGHEST_PROTOCOL)
        if len(body) > SLOT - 4:
            if self.kind == INVALID:   # only with multi-byte characters in its texts; never recurse
                return Call(INVALID, message=self.message[:40]).encode()
            return Call(INVALID, name=self.name, message=(
                f"{self.what}: a tensor of {len(self.shape or ())} dimensions does not fit a "
                f"collective's {SLOT}-byte announcement: reshape it to fewer")).encode()
        slot = bytearray(SLOT)
        struct.pack_into("<I", slot, 0, len(body))
        slot[4:4 + len(body)] = body
        return bytes(slot)

    @classmethod
    def decode(cls, slot):
        length = struct.unpack_from("<I", slot, 0)[0]
        return cls(*pickle.loads(bytes(slot[4:4 + length])))


@dataclasses.dataclass
class Outcome:
    """What every rank concludes from one round of announcements."""

    calls: list
    callers: list          # the ranks that made the call
    joined: list           # the ranks inside join()
    error: Exception = None   # raised on every caller; None: run it

    @property
    def all_joined(self):
        return not self.callers

    @property
    def first(self):
        """The call as the first caller made it (every caller's agrees, unless ``error``)."""
        return self.calls[self.callers[0]]


def decide(calls):
    joined = [r for r, c in enumerate(calls) if c.kind == JOINED]
    callers = [r for r, c in enumerate(calls) if c.kind != JOINED]
    outcome = Outcome(list(calls), callers, joined)
    if callers:
        outcome.error = _refusal(calls, callers, joined)
    return outcome


def _refusal(calls, callers, joined):
    for r in callers:
        if calls[r].kind == INVALID:
            return ConfigError(f"rank {r}: {calls[r].message}")
    first = callers[0]
    ref = calls[first]
    for r in callers[1:]:
        call = calls[r]
        if call.kind != ref.kind or (ref.name and call.name and ref.name != call.name):
            return UsageError(
                f"rank {first} called {ref.what} while rank {r} called {call.what}: every rank must "
                "make the same collective calls in the same order (a call on some ranks only, or "
                "behind a condition that differs between ranks, pairs the wrong calls); names, where "
                "given, must match too")
    if joined and ref.kind not in SERVED_BESIDE_JOIN:   # first, as Horovod reports it
        return UsageError(
            f"{ref.what}: rank(s) {joined} called eddis.join(), and a joined rank takes part only in "
            f"allreduce and barrier until every rank has joined (as in Horovod, which refuses "
            f"{ref.kind} beside a joined rank too). Call {ref.kind} before join() on every rank, or "
            "after join() returned")
    error = _mismatch(calls, callers, ref) or _out_of_range(calls, callers, ref)
    if error is None and ref.kind == "allreduce":
        error = _allreduce_rules(ref, len(calls))
    return error


_COMPARED = {   # kind -> (label, value of a call) pairs that must agree on every caller
    "allreduce": (("dtype", lambda c: c.dtype), ("shape", lambda c: c.shape), ("op", lambda c: c.op),
                  ("scale factors (prescale, postscale)", lambda c: c.factors)),
    "broadcast": (("root rank", lambda c: c.root), ("dtype", lambda c: c.dtype), ("shape", lambda c: c.shape)),
    "allgather": (("dtype", lambda c: c.dtype), ("number of dimensions", lambda c: len(c.shape)),
                  ("shape after the first dimension", lambda c: c.shape[1:])),
    "broadcast_object": (("root rank", lambda c: c.root),),
    "allgather_object": (),
    "barrier": (),
}
_COMPOSITE = (("root rank", lambda c: c.root),)


def _mismatch(calls, callers, ref):
    if ref.kind == "allgather":
        for r in callers:
            if not calls[r].shape:
                return ConfigError(
                    f"{ref.what}: rank {r} passes a 0-dimensional tensor, and allgather concatenates "
                    "along the first dimension: give it one (tensor.reshape(1))")
    first = callers[0]
    for label, value in _COMPARED.get(ref.kind, _COMPOSITE):
        for r in callers[1:]:
            if value(calls[r]) != value(ref):
                return ConfigError(
                    f"{ref.what}: the {label} differs between ranks: rank {first} has {value(ref)!r}, "
                    f"rank {r} has {value(calls[r])!r}. Every rank must pass the same")
    return None


def _out_of_range(calls, callers, ref):
    if ref.root is not None and not 0 <= ref.root < len(calls):
        return ConfigError(f"{ref.what}: root rank {ref.root} does not exist (ranks 0 to {len(calls) - 1})")
    return None


def _floating(dtype_name):
    return dtype_name.startswith(("float", "bfloat"))


def _allreduce_rules(ref, size):
    """The numeric rules of eddis.allreduce, the same on every caller."""
    if not _floating(ref.dtype) and ref.op == "adasum":
        return ConfigError(f"allreduce of an integer tensor ({ref.dtype}) with op=Adasum: Adasum "
                           "combines float tensors by their directions; reduce a float tensor, or "
                           "use op=Sum")
    prescale, postscale = ref.factors
    if not _floating(ref.dtype) and (ref.op == "average" or prescale != 1.0 or postscale != 1.0):
        return ConfigError(f"allreduce of an integer tensor ({ref.dtype}) with op={ref.op.capitalize()} "
                           f"and scale factors {prescale}, {postscale} would have to round: use "
                           "op=Sum without factors, or reduce a float tensor")
    if ref.op == "adasum":
        try:
            adasum.check_ranks(size, ref.what)
        except ConfigError as exc:
            return exc
    return None


def identity(call):
    """A joined rank's part in ``call`` (an allreduce): the op's identity in the wire dtype."""
    dtype = np.dtype(call.wire)
    if call.op in ("min", "max"):
        if dtype.kind == "b":
            value = call.op == "min"
        elif dtype.kind == "f":
            value = np.inf if call.op == "min" else -np.inf
        else:
            info = np.iinfo(dtype)
            value = info.max if call.op == "min" else info.min
        return np.full(call.count, value, dtype=dtype)
    return np.zeros(call.count, dtype=dtype)
