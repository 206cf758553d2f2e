"""Reduction operators shared by the adapters: ``Average``, ``Sum``, ``Min``, ``Max`` and
``Adasum`` (gradients and float tensors only; see ``eddis.core.comm.adasum``)."""
from ...errors import ConfigError


class ReduceOp:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name.capitalize()


Average = ReduceOp("average")
Sum = ReduceOp("sum")
Min = ReduceOp("min")
Max = ReduceOp("max")
Adasum = ReduceOp("adasum")


def resolve_op(op, average=None):
    """The ReduceOp for ``op=`` (a ReduceOp or its name) or Horovod's deprecated ``average=``."""
    if op is not None and average is not None:
        raise ConfigError("pass either op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if isinstance(op, str):
        op = ReduceOp(op.lower())
    if op.name not in ("average", "sum", "min", "max", "adasum"):
        raise ConfigError(f"unknown reduction op {op!r}; use Average, Sum, Min, Max or Adasum")
    return op


def reject_unsupported_horovod_options(gradient_predivide_factor=1.0, groups=None, num_groups=0,
                                       process_set=None):
    """Horovod options that EDDIS has no use for: a clear error instead of silently ignoring them."""
    if gradient_predivide_factor != 1.0:
        raise ConfigError("gradient_predivide_factor is not supported (the reduction accumulates "
                          "in fp32, so there is no overflow to avoid); leave it at 1.0")
    if groups is not None or num_groups:
        raise ConfigError("groups/num_groups (Horovod's tensor fusion groups) are not supported: "
                          "EDDIS buckets by size; set bucket_bytes or EDDIS_BUCKET_BYTES instead")
    if process_set is not None:
        raise ConfigError("process sets are not supported by EDDIS")
