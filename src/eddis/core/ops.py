"""Reduction operators shared by the adapters: ``Average``, ``Sum``, ``Min``, ``Max``."""
from ..errors import ConfigError


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
    if op.name == "adasum":
        raise ConfigError("Adasum is not supported by EDDIS; use op=Average (the default) or Sum")
    if op.name not in ("average", "sum", "min", "max"):
        raise ConfigError(f"unknown reduction op {op!r}; use Average, Sum, Min or Max")
    return op
