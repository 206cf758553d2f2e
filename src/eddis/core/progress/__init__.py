"""How far training is and whether the ranks still agree, between two steps.

``counter`` (the global learning counter and the staleness bound), ``driver`` (this process's
current step driver), ``join`` (``eddis.join()``: ranks that ran out of data) and
``agreement`` (the parameter check of the synchronous modes). Imports comm, layout and reduce.

``ProgressError`` and ``ProgressTimeoutError`` stay importable from here, their old address
(``eddis.core.progress``).
"""
from ...errors import ProgressError, ProgressTimeoutError  # noqa: F401
