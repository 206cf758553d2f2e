"""What a mode adds to a training step: the points where the step driver calls its hooks.

The step driver (:class:`eddis.core.hetero.step.HeteroStep`) knows no mode. Each mode's part
of the step is a hook object that the driver builds once, from the mode, and calls at every
point of every step in the order it registered them (as torchft's LocalSGD is an object
registered on the optimizer's step hooks): the simulated slowdown (:mod:`.slowdown_hook`),
the cut of each global batch and its balancing (:mod:`.shares`), the elastic averaging
through the centre variable (:mod:`.averaging`) and the final model (:mod:`.final`).

    on_attach(plan, reducer)            the parameters are known (at the first step, or again)
    before_push()                       before the step's first gradient bucket is marked ready
    before_sync(elapsed, start, flat)   the step's gradients are final
    ...                                 the wrapped optimizer's update
    after_update()                      the update is done
    end_step(step)                      step ``step`` is over
    start_step(step)                    the step counter moved on to ``step``
    close()                             the optimizer's close

A hook that needs the driver's state (the step counter, the parameters' gather and scatter)
is given the driver when it is built.
"""


class StepHook:
    """A mode's part of the step: every point does nothing unless the mode needs it."""

    def on_attach(self, plan, reducer):
        """The parameters' bucket plan and the gradient reducer (collective where the hook
        sets up shared state)."""

    def before_push(self):
        """Before this step's first gradient bucket is marked ready (a framework may call it
        from its backward thread)."""

    def before_sync(self, elapsed, start, flat):
        """The step's gradients are final: its compute began at ``start`` (perf_counter) and
        took ``elapsed`` seconds; ``flat``: the parameters in plan layout, when the adapter has
        them at hand (else None). Returns the step's compute seconds as the hooks after this
        one see them (a hook that sleeps in the step adds its sleep)."""
        return elapsed

    def after_update(self):
        """After the wrapped optimizer's update of this step."""

    def end_step(self, step):
        """Step ``step`` is over (collective where the hook decides with the other ranks)."""

    def start_step(self, step):
        """The step counter moved on to ``step``."""

    def close(self):
        """The optimizer's close: give back what the hook holds."""
