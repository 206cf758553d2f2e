"""The heterogeneity modes: what runs around the optimizer's step when the ranks differ.

``easgd`` (elastic averaging through a centre variable in SMB), ``hybrid`` (synchronous inside
a group, elastic between groups), ``balance`` (balanced sync: shares of the global batch that
follow each rank's speed), ``simulate`` (a simulated slowdown, for testing) and ``step`` (the
step driver that the adapters' optimizers call). Each mode's part of the step is a hook that
the driver registers from the mode (``hooks``): ``slowdown_hook``, ``shares``, ``averaging``
and ``final``. Imports comm, layout, reduce and progress.
"""
