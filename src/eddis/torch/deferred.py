"""EDDIS_OVERLAP_FORWARD: ``step()`` returns before its updates, and the next forward applies
each bucket's update just before a module that owns one of its parameters runs.

Backward produces the last layers' gradients first, so they are reduced first; the next forward
needs the first layers first. The sync reducer sends the bucket the next forward needs first
ahead of the others (``eddis.core.reduce.hierarchical``), and here the forward waits, module by
module, only for the buckets it is about to use: the first layers compute while the last ones'
gradients still cross the network.

A bucket's update is applied (in the order the forward asks, one bucket's parameters at a
time, as ``step()`` does bucket by bucket) when

- a module starts its forward and owns one of its parameters directly (a global forward
  pre-hook, any model),
- ``state_dict()`` of a module that ran a forward since, the optimizer's ``state_dict()``,
  EDDIS's checkpoints and parameter checks, ``optimizer.finish_step()``, ``synchronize()``,
  the next ``step()``, ``eddis.join()``, ``close()`` or ``eddis.shutdown()`` read the
  parameters,
- the next backward gives a gradient to a parameter of another bucket (buckets that no
  forward used are applied then).

Reading a parameter by other means before then (``p.data``, an EMA copy, a module that uses
another module's weight without calling it) sees its value before the step's update; a
parameter whose gradient arrives while its update is still pending was read like that, and
backward stops with a UsageError that says so.
"""
import threading
import weakref

import torch

from ..core.comm import runtime
from ..errors import UsageError

_pending = {}                  # id(parameter) -> (DeferredStep, bucket) while its update is pending
_steps = weakref.WeakSet()     # DeferredSteps with pending updates
_watched = weakref.WeakSet()   # modules whose state_dict() applies the pending updates first
_installed = []


class DeferredStep:
    """The updates of one optimizer step that wait for the forward: ``apply(k)`` runs bucket
    ``k``'s (``apply_bucket(k)``, once ``wait_bucket(k)`` says the reducer has it),
    ``finish()`` the rest, and ``done()`` once all are applied. ``wait_next(left)`` waits for
    the first of the ``left`` buckets to arrive and returns it: the next to apply when the
    forward asks for none in particular. The gradient feed asks :meth:`before_gradient`
    until the next step starts."""

    def __init__(self, plan, params, names, apply_bucket, wait_bucket, wait_next, done):
        self.left = set(range(len(plan.buckets)))
        self.late = set()   # parameters whose update the next backward applied: none read since
        self.bucket_of = {}
        self.keys = [[id(params[i]) for i in bucket.params] for bucket in plan.buckets]
        self.names = names
        self._apply_bucket = apply_bucket
        self._wait_bucket = wait_bucket
        self._wait_next = wait_next
        self._done = done
        self._lock = threading.RLock()
        for k, keys in enumerate(self.keys):
            for key in keys:
                self.bucket_of[key] = k
                _pending[key] = (self, k)
        _steps.add(self)
        install()
        runtime.register_closable(self)   # eddis.shutdown() applies what is still pending

    @property
    def pending(self):
        return bool(self.left)

    def apply(self, k, arrived=False):
        """Bucket k's update, waiting for the bucket unless it ``arrived``."""
        with self._lock:
            if k not in self.left:
                return
            if not arrived:
                self._wait_bucket(k)
            self.left.discard(k)
            for key in self.keys[k]:
                _pending.pop(key, None)
            self._apply_bucket(k)
            if not self.left:
                _steps.discard(self)
                runtime.unregister_closable(self)
                self._done()

    def finish(self):
        """Apply every update still pending, in the order the buckets arrive."""
        with self._lock:
            while self.left:
                self.apply(self._wait_next(sorted(self.left)), arrived=True)

    close = finish

    def before_gradient(self, param):
        """The next backward gives ``param`` a gradient. Its update must have been applied before
        the forward read it: the buckets no forward asked for are applied now (the reducer's next
        step needs this one ended), and a gradient of one of their parameters, now or later in
        this backward, shows that a forward read it before its update."""
        with self._lock:
            if self.left:
                self.late.update(key for key, k in self.bucket_of.items() if k in self.left)
                if id(param) not in self.late:
                    self.finish()
            if id(param) in self.late:
                raise UsageError(
                    f"parameter {self.names.get(id(param), '?')} got a gradient from a forward that read "
                    "it before the last step's update of it was applied: with EDDIS_OVERLAP_FORWARD=on, "
                    "a parameter's update is applied when a module that owns it starts its forward, and "
                    "this one is read elsewhere (a module that uses another's weight without calling "
                    "it, as nn.MultiheadAttention does with out_proj, or a functional call in the "
                    "training loop). Set EDDIS_OVERLAP_FORWARD=off, or call optimizer.finish_step() "
                    "before such a forward.")


def finish_all():
    """Apply every pending update of every optimizer (something reads the parameters)."""
    for step in list(_steps):
        step.finish()


def _before_forward(module, args):
    if _pending:
        for p in module._parameters.values():
            entry = _pending.get(id(p)) if p is not None else None
            if entry is not None:
                entry[0].apply(entry[1])
    if module not in _watched:
        _watched.add(module)
        module.register_state_dict_pre_hook(_before_state_dict)


def _before_state_dict(module, prefix, keep_vars):
    if _pending:
        finish_all()


def install():
    """The global forward pre-hook, once per process (it costs a dict lookup per module call)."""
    if not _installed:
        _installed.append(torch.nn.modules.module.register_module_forward_pre_hook(_before_forward))
