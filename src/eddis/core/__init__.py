"""EDDIS runtime core: framework-agnostic data-parallel machinery over numpy buffers.

The PyTorch adapter (``eddis.torch``) and the TensorFlow adapter
(``eddis.tensorflow``) are thin layers over this package; the heterogeneity
modes (easgd, hybrid, balanced sync) plug into it. Nothing here imports a
deep-learning framework.

Runtime (``lifecycle``, ``runtime``, ``connection``): ``init()``, ``shutdown()``, ``is_initialized()``,
``rank()``, ``size()``, ``local_rank()``, ``local_size()``, ``group()``,
``num_groups()``, ``hostname()``, ``comm()`` (private duplicate of MPI
COMM_WORLD), ``smb_client()`` (the job's SMB client; collective on first use;
starts an embedded server for single-node ``mpirun`` runs).

Gradient layout (``buckets``): ``BucketPlan([(name, shape), ...],
bucket_bytes, dtype)`` lays parameters out in one flat buffer (float32, or
float64 for float64 models) in reverse order of definition and cuts it into
buckets.

Reduction (``reducer``, ``registry``): ``make_reducer(mode, plan, compression, op)`` with
modes ``sync`` (through SMB: each rank writes its slot, the server computes
the sample-weighted average) and ``allreduce`` (MPI baseline); the reducer's
``set_weight``/``mark_ready``/``wait`` drive one step, overlapped with the
framework's backward pass on two background threads. ``register_mode`` adds a
mode.

Compression (``compression``): codecs ``NONE``, ``FP16``, ``BF16`` (``get_codec``).

Collectives over MPI that time out instead of hanging (``collectives``):
``broadcast_array``, ``allreduce_array``, ``broadcast_object``,
``allgather_object``, ``barrier``, ``check_same``.

Data sharding (``sampler``): ``shard_indices``, ``split_sizes``, ``batch_slice``
with optional per-rank weights.

Settings: EDDIS_MODE, EDDIS_COMPRESSION, EDDIS_BUCKET_BYTES,
EDDIS_COMM_TIMEOUT, EDDIS_EMBEDDED_SERVER (see ``eddis settings``).
"""
from ..errors import CollectiveTimeoutError, ReductionError, ReductionTimeoutError
from .comm.collectives import (allgather_object, allreduce_array, barrier, broadcast_array, broadcast_object,
                               check_same)
from .comm.connection import smb_client
from .comm.runtime import (comm, group, hostname, is_initialized, local_rank, local_size, num_groups, rank,
                           size)
from .layout.buckets import Bucket, BucketPlan, Slot
from .layout.compression import BF16, Codec, FP16, NONE, get_codec
from .layout.sampler import batch_slice, shard_indices, split_sizes
from .lifecycle import init, shutdown
from .reduce.allreduce import AllreduceReducer
from .reduce.base import Reducer
from .reduce.local import LocalReducer
from .reduce.registry import REDUCERS, available_modes, make_reducer, register_mode

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "group",
    "num_groups", "hostname", "comm", "smb_client",
    "BucketPlan", "Bucket", "Slot",
    "make_reducer", "register_mode", "available_modes", "Reducer", "LocalReducer",
    "AllreduceReducer", "REDUCERS", "ReductionError", "ReductionTimeoutError",
    "Codec", "NONE", "FP16", "BF16", "get_codec",
    "broadcast_array", "allreduce_array", "broadcast_object", "allgather_object", "barrier",
    "check_same", "CollectiveTimeoutError",
    "shard_indices", "split_sizes", "batch_slice",
]
