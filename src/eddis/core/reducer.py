"""The old address of the reduction errors (scripts catch
``eddis.core.reducer.ReductionError``, docs/architecture.md); the reducers are
:mod:`eddis.core.reduce`."""
from ..errors import ReductionError, ReductionTimeoutError  # noqa: F401
