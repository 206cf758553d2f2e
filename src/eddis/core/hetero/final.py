"""The job's final model, and a warning when a script trained past it.

In sync and allreduce every rank holds the same parameters: they are the final model, and
``eddis.final_model()`` has nothing to do (:class:`FinalModel`). In easgd and hybrid each worker
drifts on its own and the job's model is the centre variable; :class:`CentreFinalModel` loads
it into every rank's parameters, and at ``eddis.shutdown()`` warns when the training went on
after the last load (or never had one).
"""
import warnings

from ...errors import FinalModelWarning, UsageError
from ..comm import runtime
from .hooks import StepHook


class FinalModel:
    """The parameters are the final model: nothing to load."""

    step_at_final = None   # the step counter at the last final_model() that loaded something

    def final_model(self):
        pass

    def steps_after(self, step):
        """Local steps trained up to ``step`` since the last final model (all if none)."""
        return step - (self.step_at_final or 0)


class CentreFinalModel(FinalModel, StepHook):
    """The centre variable of ``centre`` (an :class:`.averaging.ElasticAveraging`) is the final model."""

    def __init__(self, driver, centre):
        self.driver = driver
        self.centre = centre
        self._check = None

    def on_attach(self, plan, reducer):
        if self._check is None and self.centre.averager is not None:
            self._check = _ShutdownCheck(self)
            runtime.register_closable(self._check)

    def final_model(self):
        """Collective: make every rank's parameters the centre variable."""
        driver = self.driver
        if driver.plan is None:
            raise UsageError(
                f"mode {driver.mode}: this rank's DistributedOptimizer never saw the parameters (it "
                "took no training step, and nothing built it), so it cannot meet the others' "
                "centre variable set-up; build the optimizer on every rank before training "
                "(Keras: optimizer.build(model.trainable_variables), or eddis.resume(...))")
        if self.centre.averager is None:
            return
        self.centre.load_centre()
        self.step_at_final = driver.step

    def warn_if_not_loaded(self):
        """At eddis.shutdown(): warn when easgd/hybrid trained but the parameters were left as
        this worker's own. Nothing else tells: the script runs, saves and evaluates as usual,
        only on a worker's copy instead of the job's model (the centre variable).

        Rank 0 only: final_model() is collective, so every rank is in the same case, and one
        line says it; N copies of it would bury the rest of the output."""
        driver = self.driver
        if driver.rank != 0 or self.centre.averager is None or driver.stopped_for_checkpoint is not None:
            return  # a stop to be requeued is not the end of training: the centre lives on
        steps = self.steps_after(driver.step)
        if steps <= 0:
            return
        when = ("was never called" if self.step_at_final is None
                else f"was last called {steps} step(s) before the end")
        # where the warning is raised says nothing to the script's author: name the call instead
        warnings.warn_explicit(
            f"mode {driver.mode}: this rank trained {driver.step} step(s), but eddis.final_model() "
            f"{when}, so the model's parameters are this worker's own, not the centre variable "
            "(the job's model): whatever the script evaluated or saved after training was one "
            "worker's drifted copy. Call eddis.final_model(optimizer) (collective, every rank) "
            "after training and before evaluating or saving, or save with "
            "eddis.save_checkpoint(...) (torch) / eddis.save_model(...) (TensorFlow), which call it.",
            FinalModelWarning, filename="eddis.shutdown()", lineno=0, module="eddis")


class _ShutdownCheck:
    """What eddis.shutdown() closes: the check, apart from the hook, whose close() is the
    optimizer's."""

    def __init__(self, final):
        self.final = final

    def close(self):
        self.final.warn_if_not_loaded()
