"""easgd's and hybrid's part of the step: elastic averaging through the centre variable.

Registered in modes easgd and hybrid on several ranks. When the parameters attach, the centre
variable's pools are set up (collective; :class:`.easgd.ElasticAverager`); at the first step's
``before_sync`` rank 0's parameters become the centre; after an update the exchange runs when
due (every EDDIS_EASGD_TAU steps, or with EDDIS_EASGD_OVERLAP a stripe of it after every step,
its move applied a step later). In hybrid one exchange is a group's (:mod:`.hybrid`): its
leader exchanges, the members follow. ``close`` gives the centre's SMB memory back.
"""
import logging

import numpy as np

from ... import settings
from ...errors import UsageError
from ...smb import rundir
from ..comm import collectives, connection, elastic, groups
from ..progress import join
from . import easgd, hybrid
from .hooks import StepHook

log = logging.getLogger("eddis.core.hetero")
CLOSE_TIMEOUT_S = 60.0   # how long close() waits for the other ranks before leaving the centre

_names = [0]


def centre_crosses_network(client):
    """EDDIS_EASGD_OVERLAP=auto (collective): whether some rank does not map every smb-server's
    memory, so that its exchanges with the centre (spread over every server) cross the network
    and are worth hiding behind the next step. On one node they are memory copies: a move one
    step stale would buy nothing."""
    far = len(client.mapped_servers()) < client.num_servers
    return any(collectives.allgather_object(far, what="easgd: does the centre cross the network?"))


class NoCentre:
    """The modes without a centre variable (sync, allreduce, or a single rank): the step
    driver's answers about the centre, with nothing to exchange."""

    averager = members = group_comm = join_barrier = None
    exchanging = overlap = centre_ready = needs_centre = False

    def __init__(self, mode):
        self.mode = mode

    def init_centre(self, flat=None):
        raise UsageError(f"mode {self.mode} keeps no centre variable to initialize; only easgd and "
                         "hybrid on several ranks do")

    def exchange_due(self, step):
        return False

    def exchange_flat(self, flat, step):
        return flat

    def settle(self):
        pass


class ElasticAveraging(StepHook):
    """This rank's side of the centre variable, for the step driver ``driver``."""

    def __init__(self, driver, elastic_run, group_members=None):
        """``elastic_run``: EDDIS_ELASTIC (the live ranks' membership joined at set-up);
        ``group_members``: hybrid's ``{group: [world ranks]}``."""
        self.driver = driver
        self.mode = driver.mode
        self.elastic = elastic_run
        self.group_members = group_members
        self.members = None   # elastic: who is alive (core/comm/elastic.py)
        self.group_comm = None
        self.averager = None
        self.join_barrier = None   # easgd's counted barrier of eddis.join()
        self.exchanging = False
        self.centre_ready = False
        self.freed = False
        # EDDIS_EASGD_OVERLAP: a stripe exchanged in the background after every step, its move
        # applied a step later (auto: decided with the centre, _set_up)
        self._overlap_setting = settings.get("EDDIS_EASGD_OVERLAP")
        self.overlap = self._overlap_setting is True
        self._move_pending = False
        self._move_part = None   # the stripe of the pending move: [(start, count), ...]

    # ------------------------------------------------------------ set-up
    def on_attach(self, plan, reducer):
        """Collective: the centre variable's pool set up for these parameters. Attached again
        (other parameters), the old centre is freed first, as at close."""
        if self.averager is not None:
            self.close()
        self.freed = False
        self.averager = None
        self._move_pending = False
        self.centre_ready = False
        self._set_up(plan.total)

    def _set_up(self, length):
        driver = self.driver
        if self.elastic:
            self.members = elastic.join(self.mode)
        if self.mode == "hybrid":
            members = self.group_members
            hybrid.check_groups(members)
            worker, workers = driver.group, len(members)
            self.group_comm = groups.group_comm()
            if workers == 1:
                # one group is plain sync: an elastic pull towards a centre that only
                # this group moves would merely damp its progress
                self.group_comm = None
                return
            iterations_per_step = len(members[driver.group])
            if self.members is not None:
                self.members.depend_on(members[driver.group], f"hybrid group {driver.group}")
        else:
            worker, workers = driver.rank, driver.size
            iterations_per_step = 1
        _names[0] += 1
        name = collectives.broadcast_object(f"eddis.{self.mode}.centre.h{_names[0]}", root=0,
                                            what=f"{self.mode} set-up")
        client = connection.smb_client()
        mirrored = self.members is not None and elastic.mirroring(client)   # outlives a lost node
        self.averager = easgd.ElasticAverager(client, length, worker, workers,
                                              alpha=hybrid.default_alpha(workers), name=name,
                                              iterations_per_step=iterations_per_step, mirrored=mirrored)
        # read before the centre's initialization barrier, which every rank passes before it joins
        self.join_barrier = join.ElasticJoin(client, name, mirrored=mirrored)
        self.exchanging = self.group_comm is None or self.group_comm.Get_rank() == 0
        if self._overlap_setting == "auto":
            self.overlap = centre_crosses_network(client)

    # ------------------------------------------------------------ the centre's initialization
    @property
    def needs_centre(self):
        return self.averager is not None and not self.centre_ready

    def before_sync(self, elapsed, start, flat):
        if self.needs_centre:
            self.init_centre(flat)
        return elapsed

    def init_centre(self, flat=None):
        """Collective: rank 0's parameters (``flat``, else gathered) become the centre variable."""
        if self.driver.rank == 0:
            self.averager.initialize(self.driver.gather() if flat is None else flat)
        self.barrier(f"{self.mode}: centre variable initialization")
        self.centre_ready = True
        if self.members is not None:
            # every live rank is past the collectives of the set-up: from now on a lost rank
            # leaves the others training (eddis.launch.supervisor)
            rundir.note_training_started()

    def barrier(self, what):
        """Every rank waits for every other; in elastic runs for the live ones only."""
        if self.members is not None:
            self.members.barrier(what)
        else:
            collectives.barrier(what=what)

    # ------------------------------------------------------------ the exchange
    def exchange_due(self, step):
        """After step ``step``: an exchange (EDDIS_EASGD_OVERLAP: after every step, a stripe's)."""
        return self.averager is not None and (self.overlap or self.averager.due(step) or self._move_pending)

    def exchange_flat(self, flat, step):
        """The elastic exchange after step ``step`` on ``flat`` (plan layout, float32, moved in
        place). EDDIS_EASGD_OVERLAP: the move of the stripe begun a step before, if one was,
        then this step's stripe (``ElasticAverager.stripe``) begun in the background."""
        if self.overlap:
            self._apply_pending_move(flat)
            part = self.averager.stripe(step)
            if self.exchanging:
                self.averager.start_exchange(flat, part=part)
            self._move_part = part
            self._move_pending = True
        elif self.group_comm is None:
            self.averager.exchange(flat)
        else:
            hybrid.exchange_group(self.averager, flat, self.group_comm)
        return flat

    def after_update(self):
        """The exchange when due, on the parameters. A striped exchange copies only the stripe
        it begins and the one whose move it applies."""
        driver = self.driver
        step = driver.step
        if not self.exchange_due(step):
            return
        if self.overlap:
            applied = list(self._move_part) if self._move_pending else []
            flat = self.exchange_flat(driver.gather(applied + self.averager.stripe(step)), step)
            driver.scatter(flat, applied)
        else:
            driver.scatter(self.exchange_flat(driver.gather(), step))

    def _apply_pending_move(self, flat):
        """Overlapped exchanges: ``flat -= d`` of the exchange begun a step before (a hybrid
        group's leader passes its move to the members), if one was begun."""
        if not self._move_pending:
            return
        self._move_pending = False
        moves = self.averager.take_move() if self.exchanging else None
        for i, (lo, n) in enumerate(self._move_part):
            move = None if moves is None else moves[i]
            if self.group_comm is not None:
                move = hybrid.share_group_move(self.averager, move, self.group_comm, lo, n)
            np.subtract(flat[lo:lo + n], move, out=flat[lo:lo + n])

    def settle(self):
        """Before a checkpoint: the pending move of an overlapped exchange applied to the
        parameters now (collective in a hybrid group), and this worker's last centre update
        waited for, so that what is saved is complete."""
        if self.averager is None:
            return
        if self._move_pending:
            parts = list(self._move_part)
            flat = self.driver.gather(parts)
            self._apply_pending_move(flat)
            self.driver.scatter(flat, parts)
        self.averager.finish()

    # ------------------------------------------------------------ the end
    def load_centre(self):
        """Collective: every worker's last exchange, then the centre into the parameters."""
        driver = self.driver
        if self.freed:
            raise UsageError(f"mode {self.mode}: the optimizer was closed, which released the centre "
                             "variable; call eddis.final_model() (or save the checkpoint) before "
                             "optimizer.close()")
        if not self.centre_ready:
            raise UsageError(f"mode {self.mode}: no training step was taken, so there is no centre "
                             "variable yet; ask for the final model after training")
        # a hybrid member with no move pending needs no copy of its parameters: the centre follows
        flat = driver.gather() if self.exchanging or self._move_pending else None
        self._apply_pending_move(flat)   # collective in a hybrid group
        if self.exchanging:
            self.averager.exchange(flat, measure=False)   # the last local steps count too
        self.averager.finish()
        self.barrier(f"{self.mode}: final model (every worker's last exchange)")
        driver.scatter(self.averager.read_center(out=driver.flat))
        self.barrier(f"{self.mode}: final model (centre read)")

    def close(self):
        """The optimizer's close, on every rank: free the centre variable's SMB memory once
        every rank has arrived (an SMB barrier, bounded by CLOSE_TIMEOUT_S, so a missing rank
        costs a wait and a warning, never a hang). Each optimizer has a centre of its own, so
        a job that builds several would otherwise fill the servers. Elastic runs keep it: a
        lost rank never arrives, and the servers free it when the job ends."""
        averager = self.averager
        if averager is None or self.freed or self.members is not None:
            return
        self.freed = True
        what = f"the {self.mode} centre variable {averager.name}"
        try:
            averager.finish()
        except Exception as exc:  # the servers free everything when they stop anyway
            log.warning("could not free %s: %s", what, exc)
            return
        driver = self.driver
        connection.smb_client().free_when_all_arrive(
            averager.name + ".close", driver.size, [averager.pool, averager.rates] if driver.rank == 0 else [],
            CLOSE_TIMEOUT_S, what)
