"""Checkpoints of a training run, and Horovod's elastic state on top of them.

``folders`` (the checkpoint folders on disk: names, manifest, commit, keep-last-N, the
interval and the request flag), ``verify`` (checksums, and which checkpoint a resume may
load), ``state`` (what a checkpoint holds besides the framework's tensors), ``save``
(writing one: who takes part, who commits), ``resume``, ``schedule`` (when: the step
boundaries the ranks agree on) and ``elastic_state`` (``hvd.elastic``'s state). Imports every
layer of core below it.

``request(reason)`` asks for a checkpoint and a stop at the next step boundary (signal-safe);
it is documented as ``eddis.core.checkpoint.request`` (docs/user-guide.md).
"""
from .folders import request  # noqa: F401
