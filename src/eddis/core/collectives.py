"""The old address of :class:`~eddis.errors.CollectiveTimeoutError` (scripts catch it as
``eddis.core.collectives.CollectiveTimeoutError``); the collectives are
:mod:`eddis.core.comm.collectives`."""
from ..errors import CollectiveTimeoutError  # noqa: F401
