"""The bucket plan: where each gradient lives in one flat buffer.

Parameters are given in the order the model defines them, which is roughly
the order the forward pass uses them; their gradients become ready in the
opposite order during the backward pass. The plan therefore lays parameters
out in *reverse* order and cuts that sequence into buckets of about
``bucket_bytes`` each, so bucket 0 is the first one ready and can be
on the wire while the backward pass still computes the others. A parameter
larger than ``bucket_bytes`` gets a bucket of its own, and a cut never leaves a
module's parameters (by their names) in the bucket before the one its next
parameter opens (:func:`_cut`). With ``first_bucket_bytes`` the first bucket ends
after the first module that brings it to that size (:func:`_split_first`): a small
model's whole gradient fits one bucket, which would leave nothing to send until
its backward is over.

The buffer holds ``dtype``: float32, or float64 for a model with float64
parameters, whose gradients a float32 buffer would round (the adapters pass
float64 when any parameter is float64; every reducer then sums in float64).

    plan = BucketPlan([("fc1.weight", (256, 64)), ("fc1.bias", (256,))], bucket_bytes=1 << 20)
    plan.buffer            # array of plan.total elements of plan.dtype
    plan.view(i)           # the slice of parameter i (in the caller's order)
    plan.buckets[k].start, plan.buckets[k].count, plan.buckets[k].params

The same plan on every rank is a precondition of every reducer; compare
:meth:`BucketPlan.signature` across ranks (eddis.core.comm.collectives.check_same).
"""
import hashlib
from dataclasses import dataclass, field
from math import prod
from typing import List, Tuple

import numpy as np

from ...errors import ConfigError


@dataclass
class Slot:
    """One parameter's place in the flat buffer."""
    index: int            # position in the caller's parameter list
    name: str
    shape: Tuple[int, ...]
    start: int            # first element in the flat buffer
    count: int
    bucket: int = -1


@dataclass
class Bucket:
    """A contiguous range of the flat buffer communicated as one message."""
    index: int
    start: int
    count: int
    params: List[int] = field(default_factory=list)  # caller's parameter indices
    itemsize: int = 4

    @property
    def nbytes(self):
        return self.count * self.itemsize


DTYPES = ("float32", "float64")


def gradient_dtype(dtype_names):
    """The plan dtype for parameters of these dtypes (names such as "float64", "bfloat16"):
    float64 when any is, so that none is rounded; float32 otherwise (half precision
    gradients fit into float32 exactly)."""
    return "float64" if "float64" in set(dtype_names) else "float32"


def module_of(name):
    """The module a parameter's name says it belongs to: "layer2.0.conv1.weight" -> "layer2.0.conv1",
    "dense_1/kernel:0" -> "dense_1" (a name without a separator is its own)."""
    cut = max(name.rfind("."), name.rfind("/"))
    return name[:cut] if cut > 0 else name


def _cut(slots, cap):
    """``slots`` (in the order their gradients become ready) cut into buckets of about ``cap``
    elements: a bucket closes when the next slot would overflow it, and the parameters of that
    slot's module already in it move on with it (a module's gradients are computed by one
    autograd node and become ready together: left behind, a bias of 16 KB held the bucket before
    it until the module's 67 MB weight was computed). A parameter larger than ``cap`` gets a
    bucket of its own, or one with the rest of its module."""
    buckets, count = [], 0
    for slot in slots:
        if buckets and (count == 0 or count + slot.count <= cap):
            buckets[-1].append(slot)
            count += slot.count
            continue
        moved = []
        if buckets:
            current, module = buckets[-1], module_of(slot.name)
            keep = len(current)
            while keep > 0 and module_of(current[keep - 1].name) == module:
                keep -= 1
            if keep > 0:
                moved = current[keep:]
                del current[keep:]
        buckets.append(moved + [slot])
        count = sum(s.count for s in buckets[-1])
    return buckets


def _split_first(buckets, first_cap):
    """The first of ``buckets`` cut after the first module (by its parameters' names) that
    brings it to ``first_cap`` elements, where a module follows: those gradients, ready
    first, cross while the backward computes the rest (DDP's first bucket of 1 MiB). Cut
    only there, so no module is split and no bucket is left with a part of one."""
    if not first_cap or not buckets:
        return buckets
    head, count = buckets[0], 0
    for i, slot in enumerate(head[:-1]):
        count += slot.count
        if count >= first_cap and module_of(slot.name) != module_of(head[i + 1].name):
            return [head[:i + 1], head[i + 1:]] + buckets[1:]
    return buckets


class BucketPlan:
    def __init__(self, params, bucket_bytes=25 << 20, dtype="float32", first_bucket_bytes=0):
        """``params``: sequence of (name, shape) in definition order; ``dtype``: the
        buffer's, float32 or float64 (see :func:`gradient_dtype`); ``first_bucket_bytes``:
        where the first bucket ends at the earliest (0: where any other would)."""
        if bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be positive, got {bucket_bytes}; "
                              "set EDDIS_BUCKET_BYTES to e.g. 25M")
        if first_bucket_bytes < 0:
            raise ConfigError(f"first_bucket_bytes must be >= 0, got {first_bucket_bytes}; "
                              "set EDDIS_FIRST_BUCKET_BYTES to e.g. 1M, or 0 for none")
        if np.dtype(dtype).name not in DTYPES:
            raise ConfigError(f"gradient buffers hold float32 or float64, not {dtype!r}")
        self.dtype = np.dtype(dtype)
        self.bucket_bytes = int(bucket_bytes)
        self.slots = []
        for index, (name, shape) in enumerate(params):
            shape = tuple(int(d) for d in shape)
            self.slots.append(Slot(index, str(name), shape, 0, int(prod(shape))))
        self.buckets = []
        itemsize = self.dtype.itemsize
        offset = 0
        self.first_bucket_bytes = int(first_bucket_bytes)
        cut = _cut(list(reversed(self.slots)), max(1, self.bucket_bytes // itemsize))
        for members in _split_first(cut, self.first_bucket_bytes // itemsize):
            bucket = Bucket(len(self.buckets), offset, 0, itemsize=itemsize)
            self.buckets.append(bucket)
            for slot in members:
                slot.start = offset
                slot.bucket = bucket.index
                bucket.params.append(slot.index)
                bucket.count += slot.count
                offset += slot.count
        self.total = offset
        self.buffer = np.zeros(self.total, dtype=self.dtype)
        # False once a framework placed the buffer (pinned host memory for CUDA
        # staging); a reducer may move a movable one (into mapped SMB memory)
        self.movable = True
        self._watchers = []

    def use_buffer(self, array, movable=False):
        """Make ``array`` (``dtype``, ``total`` elements, e.g. pinned host memory) the buffer;
        whoever watches the buffer (``watch_buffer``) is told of the move."""
        if array.dtype != self.dtype or array.size != self.total or array.ndim != 1:
            raise ConfigError(f"the gradient buffer must be a 1-D {self.dtype.name} array of {self.total} "
                              f"elements, got {array.dtype} with shape {array.shape}")
        old, self.buffer, self.movable = self.buffer, array, movable
        for fn in list(self._watchers):
            fn(old, array)

    def watch_buffer(self, fn):
        """Call ``fn(old, new)`` whenever the buffer moves (framework views into it must follow)."""
        self._watchers.append(fn)

    def __len__(self):
        return len(self.buckets)

    def view(self, index):
        """The flat-buffer slice of parameter ``index`` (1-D view)."""
        slot = self.slots[index]
        return self.buffer[slot.start:slot.start + slot.count]

    def bucket_view(self, k, array=None):
        b = self.buckets[k]
        arr = self.buffer if array is None else array
        return arr[b.start:b.start + b.count]

    def signature(self):
        """Text that must be identical on every rank: names, shapes and the cut."""
        lines = [f"{s.name}:{'x'.join(map(str, s.shape)) or 'scalar'}" for s in self.slots]
        lines.append(f"buckets:{','.join(str(b.count) for b in self.buckets)}")
        lines.append(f"dtype:{self.dtype.name}")
        return "\n".join(lines)

    def digest(self):
        return hashlib.sha256(self.signature().encode()).digest()

    def describe(self):
        return (f"{len(self.slots)} parameters, {self.total} elements "
                f"({self.total * self.dtype.itemsize / 2**20:.1f} MiB {self.dtype.name}) in "
                f"{len(self.buckets)} buckets")


def column_share(start, count, index, parts, align=64):
    """Share ``index`` of ``parts`` of the columns [start, start+count): [lo, hi), cut at
    multiples of ``align`` from ``start`` so that the shares' vector kernels stay aligned."""
    def cut(i):
        return start + (count * i // parts) // align * align if i < parts else start + count
    return cut(index), cut(index + 1)
