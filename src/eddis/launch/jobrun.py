"""``eddis-train --job train.py [args]``: one EDDIS job, run inside its Slurm allocation.

The job script users copy is its ``#SBATCH`` lines and this one command
(:mod:`eddis.slurm.script`), so a fix to how a job supervises its steps reaches the
copies made before it. ``eddis-train`` has checked the settings and the training
script before this starts (exit 2). Then, in order:

1. the run directory and its token (``EDDIS_RUN_DIR``, default
   ``~/.eddis/run/<SLURM_JOB_ID>``), its path exported to every step;
2. one ``smb-server`` per node of every hetjob component: a background step beside
   the trainers (``srun --overlap``), each under ``eddis-train --smb-server I``;
3. the wait for all of them to publish (``EDDIS_SERVER_WAIT``); a server step that
   ends first fails the job at once;
4. the trainers, ``srun --het-group=0,...,K-1 --mpi=pmix --kill-on-bad-exit=1
   eddis-train train.py ...``, under the trainer guard (srun can miss the end of a
   step, Slurm 22.05); a server step that ends meanwhile stops them. The trainers of an
   elastic run with more than one rank on a node start under ``mpirun`` instead
   (:mod:`eddis.launch.mpirun_step`);
5. the end of the attempt, which ``eddis-train --local`` shares (:mod:`.attempt`): the
   servers asked to stop in the run dir, so that their steps end by themselves, COMPLETED
   (``scancel`` after STOP_SECONDS for any that does not), the verdicts, the root-cause
   report when the trainers failed; then another attempt (:mod:`.restarts`), or the run
   directory retired and the job's status, the root cause's (:mod:`.runend`).

SIGTERM (scancel, the time limit): Slurm signals every step itself, so the job asks them
through the run dir to stop at once (trainers that would answer SIGTERM with a checkpoint
too), waits, bounded, for its sruns and exits 143 (:class:`JobSignals`). SIGINT (Ctrl-C) is an
interrupt: the trainers get SIGINT from their supervisors (asked through the run dir),
the scripts' KeyboardInterrupt handlers run, the servers end after the trainers, and
the job exits 130.

SIGUSR1 (``#SBATCH --signal=B:USR1@N``: the time limit is N seconds away) asks the
trainers for a checkpoint: a request file in the run directory and SIGUSR1 to the
trainer step. Trainers that wrote it answer in the run directory and exit 0; the job
then stops its servers, retires the run directory and requeues itself
(``scontrol requeue``, at most ``EDDIS_MAX_REQUEUES`` times), and its next run resumes
from that checkpoint (``eddis.resume``): the requeue handler of :mod:`.runend`.

EDDIS_MAX_RESTARTS: after the trainers failed the job runs 2.-5. again, at most that many
times, without the nodes Slurm says failed (:mod:`eddis.launch.placement`; spare nodes,
EDDIS_SPARE_NODES, keep the job's layout), or ends saying which failed when too few remain;
EDDIS_START_RETRIES: once more after a rank crashed before its eddis.init() returned.

Preemption (:mod:`.preemption`) signals the steps, not the job. With EDDIS_CHECKPOINT_DIR
the trainers write a checkpoint and stop while the servers stay up; when the trainers stopped
after SIGTERM, the job asks Slurm whether it was preempted and, if so, requeues itself at
once (not counted against ``EDDIS_MAX_REQUEUES``): Slurm requeues a preempted job only if it
is still running at the end of its grace time, and ends one whose script exits before.
"""
import os
import signal
import threading
import time

from ..errors import ConfigError, JobSignalled
from . import jobsteps, placement, preemption
from .allocation import components, job_nodes
from .attempt import Launcher, end_attempt
from .elastic import elastic_run, survives_server_loss
from .jobsignals import CHECKPOINT_SIGNAL, JobSignals
from .jobsteps import TRAINER_STEP_NAME
from .report import request_servers_stop, request_stop
from .restarts import run_attempts
from .runend import conclude
from .status import exit_status
from .stepcommands import (SERVER_STEP_NAME, launched_by_mpirun, server_count, server_step_command,
                           server_steps_end_training, trainer_step_command)
from .stepcontrol import (POLL_SECONDS, end_server_steps, running, scancel, start_step, stop_mpirun, stop_steps,
                          wait_ended)
from .topwatch import TopWatch

# for the sruns to end once Slurm signalled the job; Slurm's KillWait (30 s by default) ends the rest
SIGNAL_WAIT_SECONDS = 30.0
GUARD_JOIN_SECONDS = 15.0  # the guard may be inside one squeue call when srun ends
# the ranks of a killed server's peers fail at once; srun may report the server's step later
SERVER_END_GRACE_SECONDS = 3.0


class Job(Launcher):
    """The steps of one EDDIS job and their supervision; :meth:`run` returns its exit status."""

    prefix = "eddis_job"
    steps = "the smb-servers and trainers"
    where = " in this allocation"
    trainers = "the trainers"

    def __init__(self, train):
        self.train = list(train)
        self.job_id = os.environ.get("SLURM_JOB_ID")
        if not self.job_id:
            raise ConfigError("SLURM_JOB_ID is not set: eddis-train --job runs as the command of a Slurm "
                              "batch job script (sbatch eddis_job.sh train.py); without Slurm use "
                              "eddis-train --local")
        self.components = components(os.environ)
        self.nodes_started = job_nodes(os.environ)
        self.batch_host = os.environ.get("SLURMD_NODENAME")
        self.placement = placement.first_placement(self.nodes_started, self.components, os.environ,
                                                   self.batch_host)
        self.signals = JobSignals()
        self.run_dir = None
        self.servers = []
        self.trainer = None
        self.trainer_by_mpirun = False   # an elastic run's mpirun, not srun (trainer_step_command)
        self.checkpoint_requested = False  # passed on to the trainers
        self.topwatch = None  # this process's sentinel (.topwatch), once the run dir exists

    @property
    def stopping(self):
        return self.signals.stopping

    @property
    def tool(self):
        return "mpirun" if self.trainer_by_mpirun else "srun"

    def run(self):
        try:
            return self._supervise()
        finally:
            if self.topwatch is not None:
                self.topwatch.close()

    def _supervise(self):
        from ..smb.rundir import retire_run_dir

        self.signals.install()
        status = answer = None
        try:
            status, answer = self._run()
        except JobSignalled as stop:
            if stop.signum == signal.SIGINT and self.trainer is not None:
                self.say("interrupted (SIGINT): the trainers get SIGINT (KeyboardInterrupt), then SIGTERM after "
                         "EDDIS_INTERRUPT_GRACE s", err=True)
                self._interrupt_trainers()
            else:
                self.say(f"{stop} received, the trainers and smb-servers are stopping", err=True)
                self._stop_steps_now(f"the job received {stop}")
                if stop.signum == signal.SIGTERM and self.run_dir is not None \
                        and preemption.requeued_by_slurm(self.job_id):
                    preemption.count_preemption(self.run_dir)  # Slurm's requeue, not the job's own
                    self.say("preempted by Slurm, and its grace time is over: Slurm requeues the job, which "
                             "resumes from its last checkpoint, if any", err=True)
                wait_ended(self._sruns(), SIGNAL_WAIT_SECONDS)
        finally:
            self.signals.disarm()
            if self.run_dir is not None:
                retire_run_dir(self.run_dir)  # the token must not outlive the job
        return conclude(self, status, answer)

    def _stop_steps_now(self, reason):
        """The job itself was signalled (scancel, the time limit): its steps, which Slurm signals
        too, stop at once, also where they would have answered SIGTERM with a checkpoint."""
        if self.run_dir is None:
            return
        try:
            request_stop(self.run_dir, reason, signal.SIGTERM)
            request_servers_stop(self.run_dir, reason)
        except OSError as exc:
            self.say(f"cannot ask the steps to stop in {self.run_dir}: {exc}", err=True)

    def _interrupt_trainers(self):
        """The interrupt reaches the trainers as the stop request in the run dir that names
        SIGINT (what ``eddis-train --local`` writes), not through srun, which takes one SIGINT
        for a status report and two within a second as the order to kill every task. Each
        rank's supervisor passes SIGINT on once and gives the script EDDIS_INTERRUPT_GRACE s
        for its KeyboardInterrupt handler; the servers stay up meanwhile (a handler may save
        through them) and end by themselves afterwards."""
        from .. import settings

        request_stop(self.run_dir, "the job received SIGINT", signal.SIGINT)
        wait_ended([self.trainer], settings.get("EDDIS_INTERRUPT_GRACE") + settings.get("EDDIS_STOP_GRACE")
                   + SIGNAL_WAIT_SECONDS)
        if running([self.trainer]):
            self._stop_trainers("the trainers did not end after the job's SIGINT")
        self.end_servers()

    def _stop_trainers(self, reason):
        if self.trainer_by_mpirun:
            stop_mpirun(self.run_dir, self.trainer, reason)
        else:
            stop_steps(TRAINER_STEP_NAME, [self.trainer])

    def _sruns(self):
        return [p for p in [self.trainer, *self.servers] if p is not None]

    def _run(self):
        from ..slurm.nodes import job_no_kill
        from ..smb.rundir import default_run_dir

        run_dir = str(default_run_dir())
        os.environ["EDDIS_RUN_DIR"] = run_dir  # one run dir for every step of the job
        try:
            self.run_dir = jobsteps.create_run_dir(run_dir)
        except OSError as exc:
            self.say(f"error: cannot create the run directory {run_dir}: {exc}", err=True)
            return 1, None
        self.say(f"job {self.job_id}, {len(self.components)} component(s), run dir {run_dir}")
        # stopped or wedged, this process would hold the allocation until the time limit: its
        # sentinel then ends the job in its place
        self.topwatch = TopWatch("eddis-train --job", self.run_dir).start()
        if self.placement is not None:
            spares = [n for n in self.nodes_started if n not in self.placement.nodes]
            self.say(f"the smb-servers and trainers run on {','.join(self.placement.nodes)}; spare node(s) "
                     f"{','.join(spares)} (EDDIS_SPARE_NODES)")
            warning = placement.spares_without_no_kill(spares, job_no_kill(self.job_id))
            if warning is not None:
                self.say(warning, err=True)
        return run_attempts(self)

    def replan(self):
        self.placement, enough = placement.without_failed_nodes(
            self.job_id, self.nodes_started, self.placement, self.batch_host, lambda text: self.say(text, err=True))
        return enough

    def end_servers(self):
        end_server_steps(self.run_dir, self.servers)

    def attempt(self):
        """One run of the job's steps: the servers, the trainers, then the shared end."""
        self.servers, self.trainer, self.checkpoint_requested = [], None, False
        first = 0
        for component in self.components:
            self.servers.append(start_step(server_step_command(component, first, self.placement)))
            first += component.nodes
        if jobsteps.wait_servers(self.run_dir, server_count(self.components, self.placement),
                                 watch_pids=[p.pid for p in self.servers]) != 0:
            # asked in the run dir too: with EDDIS_CHECKPOINT_DIR a server outlives one SIGTERM
            request_servers_stop(self.run_dir, "the smb-servers did not all start")
            stop_steps(SERVER_STEP_NAME, self.servers)
            return 1, None
        return end_attempt(self, self._train())

    def _train(self):
        """Start the trainers and wait for them: srun's (or mpirun's) status."""
        command = trainer_step_command(self.components, self.train, self.placement)
        self.trainer_by_mpirun = launched_by_mpirun(command)
        self.trainer = start_step(command)
        # srun can miss the end of a step whose ranks have all exited, and mpirun never learns
        # that the ranks of a lost node ended: the guard bounds that wait
        guard = threading.Thread(target=jobsteps.guard_trainer_step, args=(self.run_dir, self.trainer.pid),
                                 kwargs={"elastic": self.trainer_by_mpirun, "watch_start": elastic_run()},
                                 name="trainer-guard", daemon=True)
        guard.start()
        status = self._wait_trainers()
        guard.join(GUARD_JOIN_SECONDS)  # it returns once it finds srun's process gone
        return status

    def _wait_trainers(self):
        """The trainers' status; bounded by the trainer guard, the server steps and the job's time limit."""
        survivable = survives_server_loss()
        noted = set()
        while True:
            if self.trainer.poll() is not None:
                status = exit_status(self.trainer.returncode)
                if status != 0:
                    self._name_ended_servers(status, survivable)
                return status
            if self.signals.checkpoint_asked and not self.checkpoint_requested:
                self._request_checkpoint()
            ended, cause = self._servers_ended(survivable)
            if cause:
                self.say(f"{cause} during training; stopping the trainers", err=True)
                self._stop_trainers(cause)
                return 1
            for step in (p for p in ended if p.pid not in noted):
                noted.add(step.pid)   # a hetjob component's servers, lost with its node(s)
                self.say(f"an smb-server step ended (status {exit_status(step.returncode)}) during training; "
                         "elastic run with mirrored state: the trainers go on", err=True)
            time.sleep(POLL_SECONDS)

    def _servers_ended(self, survivable):
        """The server steps that have ended, and the cause to name when training cannot go on
        without them (None while it can)."""
        ended = [p for p in self.servers if p.poll() is not None]
        if ended and server_steps_end_training(len(ended), len(self.servers), survivable):
            return ended, f"an smb-server step ended (status {exit_status(ended[0].returncode)})"
        return ended, None

    def _name_ended_servers(self, status, survivable):
        """Failed trainers whose smb-server step ended too: name the server's end as the cause,
        waiting briefly for srun to report it."""
        deadline = time.monotonic() + SERVER_END_GRACE_SECONDS
        while True:
            cause = self._servers_ended(survivable)[1]
            if cause:
                self.say(f"{cause} during training; the trainers stopped with status {status}", err=True)
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(POLL_SECONDS)

    def _request_checkpoint(self):
        """Pass Slurm's warning on: a request file for trainers not listening yet, and
        SIGUSR1 to the trainer step (its supervisors forward it to their trainers)."""
        from ..smb.rundir import request_checkpoint

        self.checkpoint_requested = True
        request_checkpoint(self.run_dir, "the job's time limit is near (Slurm sent SIGUSR1)")
        if self.trainer_by_mpirun:
            self.trainer.send_signal(CHECKPOINT_SIGNAL)   # mpirun passes SIGUSR1 on to every rank
        else:
            steps = jobsteps.step_ids(TRAINER_STEP_NAME)
            if steps:
                scancel([f"--signal={CHECKPOINT_SIGNAL.name.removeprefix('SIG')}", *steps])
        self.say("the time limit is near (SIGUSR1 from Slurm): asking the trainers for a checkpoint")


def run_job(train):
    """``eddis-train --job``: run the job, return its exit status."""
    return Job(train).run()
