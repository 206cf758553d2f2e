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
5. the servers asked to stop in the run dir, so that their steps end by themselves,
   COMPLETED (``scancel`` after STOP_SECONDS for any that does not), the root-cause
   report when the trainers failed, the run directory retired; the job's status is the
   root cause's.

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
from that checkpoint (``eddis.resume``).

EDDIS_MAX_RESTARTS: after the trainers failed the job runs 2.-5. again, at most that many
times, without the nodes Slurm says failed (:mod:`eddis.launch.placement`; spare nodes,
EDDIS_SPARE_NODES, keep the job's layout), or ends saying which failed when too few remain.

Preemption (:mod:`.preemption`) signals the steps, not the job. With EDDIS_CHECKPOINT_DIR
the trainers write a checkpoint and stop while the servers stay up; when the trainers stopped
after SIGTERM, the job asks Slurm whether it was preempted and, if so, requeues itself at
once (not counted against ``EDDIS_MAX_REQUEUES``): Slurm requeues a preempted job only if it
is still running at the end of its grace time, and ends one whose script exits before.
"""
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, JobSignalled, NodeFailureError
from . import jobsteps, mpirun_step, placement, preemption
from .hostlist import expand_hostlist
from .elastic import elastic_run, elastic_status, survives_server_loss
from .report import LAUNCH_DIR, describe_failure, request_servers_stop, request_stop, root_cause, start_up_crash
from .status import INTERRUPTED_STATUS, SIGNALLED_STATUS, exit_status
from .topwatch import TopWatch

SERVER_STEP_NAME = "smb-server"
TRAINER_STEP_NAME = jobsteps.TRAINER_STEP_NAME
STOP_SECONDS = 30.0  # for the steps to end after scancel --signal=TERM
# for the sruns to end once Slurm signalled the job; Slurm's KillWait (30 s by default) ends the rest
SIGNAL_WAIT_SECONDS = 30.0
SLURM_ASK_SECONDS = 1.0  # between two squeue calls while steps stop
SLURM_COMMAND_TIMEOUT = 10.0
GUARD_JOIN_SECONDS = 15.0  # the guard may be inside one squeue call when srun ends
POLL_SECONDS = 0.2
# #SBATCH --signal=B:USR1@N (eddis.slurm.script): the time limit is N seconds away
CHECKPOINT_SIGNAL = signal.SIGUSR1


# ---------------------------------------------------------------- the allocation, from Slurm's variables
@dataclass(frozen=True)
class Component:
    """One hetjob component (the whole job when it is not a hetjob)."""

    group: Optional[int]  # its --het-group; None for a job of one component
    nodes: int
    cpus_per_node: int  # the fewest CPUs the job holds on one of its nodes

    def het_group_option(self):
        return [] if self.group is None else [f"--het-group={self.group}"]


def fewest_cpus(text):
    """The fewest CPUs per node in Slurm's SLURM_JOB_CPUS_PER_NODE form ("16(x2),8" -> 8); 1 if none."""
    counts = [part.split("(")[0].strip() for part in (text or "").split(",")]
    return min((int(c) for c in counts if c.isdigit()), default=1)


def _count(env, name, default=None):
    text = env.get(name)
    if not text:
        if default is not None:
            return default
        raise ConfigError(f"{name} is not set: eddis-train --job runs as the command of a Slurm batch "
                          "job script (sbatch eddis_job.sh train.py)")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} from Slurm is not a whole number") from None


def components(env):
    """The job's components, from SLURM_HET_SIZE and the per-component SLURM_*_HET_GROUP_<g>."""
    size = _count(env, "SLURM_HET_SIZE", default=1)
    if size <= 1:
        return [Component(None, _count(env, "SLURM_JOB_NUM_NODES"),
                          fewest_cpus(env.get("SLURM_JOB_CPUS_PER_NODE")))]
    return [Component(g, _count(env, f"SLURM_JOB_NUM_NODES_HET_GROUP_{g}"),
                      fewest_cpus(env.get(f"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{g}")))
            for g in range(size)]


# ---------------------------------------------------------------- the steps' command lines
def server_step_command(component, first_index, nodes=None):
    """The srun of one component's smb-servers, one per node, indexed from ``first_index``;
    on the nodes of ``nodes`` (a :class:`~eddis.launch.placement.Placement`) when given.

    The step may use every CPU the job holds on the node (it overlaps the trainers): the
    servers' reduction threads (SMB_REDUCE_THREADS) would share one bound CPU otherwise.
    An elastic run with mirrored state outlives a lost server, so its task must not take
    the other servers down with it."""
    where = (nodes.step_options(tasks_per_node=1) if nodes is not None and nodes.narrowed else
             [f"--nodes={component.nodes}", f"--ntasks={component.nodes}", "--ntasks-per-node=1"])
    kill = "--kill-on-bad-exit=0" if survives_server_loss() else "--kill-on-bad-exit=1"
    return ["srun", *component.het_group_option(), f"--job-name={SERVER_STEP_NAME}", "--overlap", *where,
            f"--cpus-per-task={component.cpus_per_node}", "--gres=none", kill,
            # a server's index needs its node's place in the step, which only that node knows
            "bash", "-c", f"exec eddis-train --smb-server $(({first_index} + SLURM_NODEID))"]


def trainer_step_command(parts, train, nodes=None, env=None):
    """The launch of the trainers: one rank per task of every component, one MPI world; on the
    nodes of ``nodes`` (a :class:`~eddis.launch.placement.Placement`) when given.

    ``srun --mpi=pmix``, except in an elastic run with more than one rank on a node: there
    ``mpirun`` inside the allocation (:mod:`eddis.launch.mpirun_step`), since Slurm's PMIx plugin
    kills the whole step when a rank that shares its node with another is lost. Sets
    EDDIS_HOST_GROUPS in ``env`` (default: this process's environment, which the launch
    inherits) for mpirun's ranks."""
    elastic = elastic_run()
    if elastic:
        env = os.environ if env is None else env
        hosts = mpirun_step.trainer_hosts(env, nodes)
        if mpirun_step.needs_mpirun(hosts):
            env["EDDIS_HOST_GROUPS"] = mpirun_step.host_groups_text(hosts)
            return mpirun_step.mpirun_command(hosts, train)
    het = [f"--het-group={','.join(str(c.group) for c in parts)}"] if len(parts) > 1 else []
    # elastic runs: a lost rank's task must not take the survivors' step down with it (said
    # explicitly: a cluster's KillOnBadExit=1 would otherwise)
    kill = "--kill-on-bad-exit=0" if elastic else "--kill-on-bad-exit=1"
    where = [] if nodes is None else nodes.step_options()
    return ["srun", *het, f"--job-name={TRAINER_STEP_NAME}", "--mpi=pmix", kill, *where, "eddis-train", *train]


def launched_by_mpirun(argv):
    return bool(argv) and argv[0] == "mpirun"


def server_steps_end_training(ended, steps, survivable):
    """Whether ``ended`` of the job's ``steps`` smb-server steps (one per hetjob component)
    having ended stops the trainers: any of them, unless the state outlives a lost server
    (``survivable``: elastic and mirrored), where only all of them do."""
    return ended >= steps if survivable else ended > 0


def server_count(parts, nodes=None):
    return len(nodes.nodes) if nodes is not None and nodes.narrowed else sum(c.nodes for c in parts)


def job_nodes(env):
    """Every node the job started with, in component order (SLURM_JOB_NODELIST[_HET_GROUP_<g>])."""
    size = _count(env, "SLURM_HET_SIZE", default=1)
    if size <= 1:
        return placement.allocation_nodes(env)
    return tuple(n for g in range(size) for n in expand_hostlist(env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}", "")))


# ---------------------------------------------------------------- steps as processes
def start_step(argv):
    # srun would pass the job's stdin on to the step's first task
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


def running(sruns):
    return [p for p in sruns if p.poll() is None]


def wait_ended(sruns, seconds, poll=POLL_SECONDS):
    """Wait until every srun has ended, at most ``seconds``; the ones still running."""
    deadline = time.monotonic() + seconds
    while running(sruns) and time.monotonic() < deadline:
        time.sleep(poll)
    return running(sruns)


def scancel(args, env=None):
    try:
        subprocess.run(["scancel", *args], capture_output=True, timeout=SLURM_COMMAND_TIMEOUT,
                       env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired):
        pass  # the kill that follows ends the sruns; Slurm ends their steps with the job


def _wait_steps(name, sruns, env, wait, poll):
    """Wait, at most ``wait`` s, for the sruns of this job's steps named ``name`` to end.
    srun can miss the end of a hetjob step (Slurm 22.05): once Slurm lists none of these
    steps any more, their sruns get STEP_GONE_GRACE s. True when Slurm lists them no more."""
    deadline = time.monotonic() + wait
    next_ask = time.monotonic() + SLURM_ASK_SECONDS
    gone_at = None
    while running(sruns) and time.monotonic() < deadline:
        now = time.monotonic()
        if now >= next_ask:
            next_ask = now + SLURM_ASK_SECONDS
            if jobsteps.step_ids(name, env) == []:
                gone_at = gone_at or now
                if now - gone_at >= jobsteps.STEP_GONE_GRACE:
                    break
        time.sleep(poll)
    return gone_at is not None


def _kill_waiting(sruns, poll):
    for srun in running(sruns):  # an srun still waiting for a step that has ended
        srun.kill()
    wait_ended(sruns, SLURM_COMMAND_TIMEOUT, poll)


def stop_steps(name, sruns, env=None, wait=STOP_SECONDS, poll=POLL_SECONDS):
    """Stop this job's steps named ``name`` and wait, bounded, for their sruns (Popen objects).

    SIGTERM through scancel, not to srun: srun answers SIGTERM with SIGKILL, which would
    leave the servers' shared memory behind. What is left after ``wait`` s (or once Slurm
    lists none of the steps, :func:`_wait_steps`) is cancelled, and its srun killed."""
    sruns = [p for p in sruns if p is not None]
    if not sruns:
        return
    steps = jobsteps.step_ids(name, env) or []
    if steps:
        scancel(["--signal=TERM", *steps], env)
    _wait_steps(name, sruns, env, wait, poll)
    if steps and running(sruns):
        scancel(steps, env)
    _kill_waiting(sruns, poll)


def stop_mpirun(run_dir, mpirun, reason, env=None, wait=STOP_SECONDS, poll=POLL_SECONDS):
    """Stop the elastic trainers' ``mpirun`` (a Popen) and wait, bounded, for it: first through the
    run dir, where every rank's supervisor stops its trainer gently (EDDIS_STOP_GRACE), then
    SIGTERM to mpirun, which passes it on to the supervisors and ends them soon after; what is
    left ``wait`` s later is killed, the nodes' daemon steps cancelled."""
    from .. import settings

    if mpirun is None or mpirun.poll() is not None:
        return
    request_stop(run_dir, reason, signal.SIGTERM)
    if not wait_ended([mpirun], settings.get("EDDIS_STOP_GRACE") + wait, poll):
        return
    mpirun.send_signal(signal.SIGTERM)
    if not wait_ended([mpirun], wait, poll):
        return
    steps = jobsteps.step_ids(TRAINER_STEP_NAME, env) or []
    if steps:
        scancel(steps, env)
    jobsteps.kill_tree(mpirun.pid)
    wait_ended([mpirun], SLURM_COMMAND_TIMEOUT, poll)


def end_server_steps(run_dir, sruns, env=None, wait=STOP_SECONDS, poll=POLL_SECONDS):
    """End the smb-server steps of a job whose trainers have ended: every server's supervisor
    is asked in the run dir to stop its server, and exits 0, so that its step ends COMPLETED
    and slurmstepd prints nothing (a cancelled step prints ``error: *** STEP ... CANCELLED ***``
    into the job's output). Steps still running after ``wait`` s are cancelled
    (:func:`stop_steps`), and the job's output says so."""
    sruns = [p for p in sruns if p is not None]
    if not running(sruns):
        return
    request_servers_stop(run_dir, "the job's trainers have ended")
    if _wait_steps(SERVER_STEP_NAME, sruns, env, wait, poll) or not running(sruns):
        _kill_waiting(sruns, poll)
        return
    say(f"eddis_job: {len(running(sruns))} smb-server step(s) did not end within {wait:.0f} s of the "
        "request to stop; cancelling them", sys.stderr)
    stop_steps(SERVER_STEP_NAME, sruns, env, wait, poll)


def trainers_status(run_dir, status):
    """The status the trainer guard wrote when it had to end srun, else ``status``."""
    try:
        return int((Path(run_dir) / LAUNCH_DIR / jobsteps.TRAINERS_STATUS_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return status


# ---------------------------------------------------------------- signals
class JobSignals:
    """What the job does with the signals Slurm sends its batch step.

    SIGTERM and SIGINT (scancel, the time limit) stop the job: the first raises
    :class:`JobSignalled` in the main thread; later ones, and any once the job is
    finishing, are ignored. A signal that must not stop the job (a checkpoint request,
    ``#SBATCH --signal=B:USR1@...``) gets its own entry in :meth:`handlers`."""

    def __init__(self):
        self.stopping = None
        self.armed = False
        self.checkpoint_asked = False  # Slurm's warning before the time limit came

    def handlers(self):
        return {signal.SIGTERM: self._stop, signal.SIGINT: self._stop, CHECKPOINT_SIGNAL: self._ask_checkpoint}

    def _ask_checkpoint(self, signum, frame):
        # only noted here: the main loop passes it on (squeue and scancel are no work for a handler)
        self.checkpoint_asked = True

    def install(self):
        for signum, handler in self.handlers().items():
            signal.signal(signum, handler)
        self.armed = True
        return self

    def disarm(self):
        self.armed = False

    def _stop(self, signum, frame):
        if not self.armed or self.stopping is not None:
            return
        self.stopping = signum
        raise JobSignalled(signum)


# ---------------------------------------------------------------- the job
def say(text, stream=None):
    print(text, file=stream or sys.stdout, flush=True)


class Job:
    """The steps of one EDDIS job and their supervision; :meth:`run` returns its exit status."""

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
        self.placement = self._first_placement()
        self.signals = JobSignals()
        self.run_dir = None
        self.servers = []
        self.trainer = None
        self.trainer_by_mpirun = False   # an elastic run's mpirun, not srun (trainer_step_command)
        self.checkpoint_requested = False  # passed on to the trainers
        self.answer = None  # the checkpoint the trainers wrote on request, then stopped
        self.topwatch = None  # this process's sentinel (.topwatch), once the run dir exists

    def _first_placement(self):
        """Where the steps run at first: every node, or all but EDDIS_SPARE_NODES of them."""
        from .. import settings

        spare = settings.get("EDDIS_SPARE_NODES")
        if not spare:
            return None
        if len(self.components) > 1:
            raise ConfigError(f"EDDIS_SPARE_NODES={spare} is for a job of one component, and this hetjob "
                              f"has {len(self.components)}: each component's trainers use all its nodes. "
                              "Unset EDDIS_SPARE_NODES, or submit one GPU type with spare nodes")
        return placement.plan(self.nodes_started, spare, placement.tasks_per_node(os.environ),
                              batch_host=self.batch_host)

    def run(self):
        try:
            return self._supervise()
        finally:
            if self.topwatch is not None:
                self.topwatch.close()

    def _supervise(self):
        self.signals.install()
        try:
            status = self._run()
        except JobSignalled as stop:
            if stop.signum == signal.SIGINT and self.trainer is not None:
                say("eddis_job: interrupted (SIGINT): the trainers get SIGINT (KeyboardInterrupt), "
                    "then SIGTERM after EDDIS_INTERRUPT_GRACE s", sys.stderr)
                self._interrupt_trainers()
            else:
                say(f"eddis_job: {stop} received, the trainers and smb-servers are stopping", sys.stderr)
                self._stop_steps_now(f"the job received {stop}")
                if stop.signum == signal.SIGTERM and self.run_dir is not None \
                        and preemption.requeued_by_slurm(self.job_id):
                    preemption.count_preemption(self.run_dir)  # Slurm's requeue, not the job's own
                    say("eddis_job: preempted by Slurm, and its grace time is over: Slurm requeues the job, "
                        "which resumes from its last checkpoint, if any", sys.stderr)
                wait_ended(self._sruns(), SIGNAL_WAIT_SECONDS)
            status = None
        finally:
            self.signals.disarm()
            if self.run_dir is not None:
                self._retire()
        if status is None:
            status = 128 + self.signals.stopping if self.signals.stopping else SIGNALLED_STATUS
            interrupted = self.signals.stopping == signal.SIGINT
            say(f"eddis_job: {'interrupted' if interrupted else 'stopped'}, status {status}", sys.stderr)
            return status
        if (status == 0 and self.answer is not None) or status == SIGNALLED_STATUS:
            return self._stopped_early(status)
        if status == 0:
            say("eddis_job: done, status 0")
        else:
            say(f"eddis_job: failed, status {status}", sys.stderr)
        return status

    def _stop_steps_now(self, reason):
        """The job itself was signalled (scancel, the time limit): its steps, which Slurm signals
        too, stop at once, also where they would have answered SIGTERM with a checkpoint."""
        if self.run_dir is None:
            return
        try:
            request_stop(self.run_dir, reason, signal.SIGTERM)
            request_servers_stop(self.run_dir, reason)
        except OSError as exc:
            say(f"eddis_job: cannot ask the steps to stop in {self.run_dir}: {exc}", sys.stderr)

    def _stopped_early(self, status):
        """The trainers stopped before training was over: after a checkpoint they were asked
        for (status 0 and an answer), or after SIGTERM to the steps alone (143). A preemption
        requeues the job; a time-limit warning too (bounded); a bare SIGTERM does not."""
        terminated = self.answer is None or self.answer.get("terminated", False)
        if not terminated:
            return self._requeue()
        preempted = preemption.preempted(self.job_id)
        if preempted:
            return self._requeue(preempted=True)
        where = self._checkpoint_written()
        if preempted is None:
            say("eddis_job: the trainers stopped on SIGTERM, and `scontrol show job` could not tell whether "
                "Slurm preempted the job; not requeued" + (f": resubmit to resume from {where}" if where else ""),
                sys.stderr)
        elif where is not None:
            say(f"eddis_job: the trainers stopped on SIGTERM after writing {where}; the job was not preempted "
                "(Slurm shows no PreemptTime: scancel --signal=TERM?), so it is not requeued: resubmit it to "
                "resume", sys.stderr)
        say(f"eddis_job: stopped, status {SIGNALLED_STATUS}", sys.stderr)
        return SIGNALLED_STATUS

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
        end_server_steps(self.run_dir, self.servers)

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
            say(f"eddis_job: error: cannot create the run directory {run_dir}: {exc}", sys.stderr)
            return 1
        say(f"eddis_job: job {self.job_id}, {len(self.components)} component(s), run dir {run_dir}")
        # stopped or wedged, this process would hold the allocation until the time limit: its
        # sentinel then ends the job in its place
        self.topwatch = TopWatch("eddis-train --job", self.run_dir).start()
        if self.placement is not None:
            spares = [n for n in self.nodes_started if n not in self.placement.nodes]
            say(f"eddis_job: the smb-servers and trainers run on {','.join(self.placement.nodes)}; "
                f"spare node(s) {','.join(spares)} (EDDIS_SPARE_NODES)")
            warning = placement.spares_without_no_kill(spares, job_no_kill(self.job_id))
            if warning is not None:
                say(f"eddis_job: {warning}", sys.stderr)
        restarts = retries = 0
        while True:
            status = self._attempt()
            if status in (0, INTERRUPTED_STATUS, SIGNALLED_STATUS) or self.signals.stopping is not None:
                return status  # done, or stopped on purpose (Ctrl-C, scancel): nothing to run again
            if self._retry_start_up(retries):
                retries += 1
            elif self._restart_after(restarts):
                restarts += 1
            else:
                return status
            os.environ["EDDIS_RESTART_COUNT"] = str(restarts + retries)
            self.run_dir = jobsteps.create_run_dir(self.run_dir)  # the failed attempt's records are reported

    def _retry_start_up(self, retries):
        """Whether to run the steps again after a rank crashed before its eddis.init() returned
        (EDDIS_START_RETRIES): Open MPI 4.1 under Slurm's PMIx crashes inside MPI_Init about
        once in 250 starts on a loaded node, and a second start does not meet the same race."""
        from .. import settings

        crash = start_up_crash(self.run_dir)
        if crash is None:
            return False
        limit = settings.get("EDDIS_START_RETRIES")
        what = f"{describe_failure(crash)} before eddis.init() returned"
        if retries >= limit:
            if limit > 0:
                say(f"eddis_job: {what}, again after {retries} start retry(ies) (EDDIS_START_RETRIES={limit})",
                    sys.stderr)
            return False
        say(f"eddis_job: {what}: a crash in the start-up (Open MPI 4.1 under Slurm's PMIx crashes inside "
            f"MPI_Init about once in 250 starts); starting the smb-servers and trainers again (start retry "
            f"{retries + 1} of {limit}, EDDIS_START_RETRIES)", sys.stderr)
        return True

    def _restart_after(self, restarts):
        """Whether to run the steps again after the trainers failed (EDDIS_MAX_RESTARTS)."""
        from .. import settings

        limit = settings.get("EDDIS_MAX_RESTARTS")
        if limit <= 0:
            return False
        if restarts >= limit:
            say(f"eddis_job: the trainers failed again after {restarts} restart(s) (EDDIS_MAX_RESTARTS={limit}); "
                "the job ends", sys.stderr)
            return False
        if not self._place_without_failed_nodes():
            return False
        say(f"eddis_job: restarting the smb-servers and trainers in this allocation (restart {restarts + 1} "
            f"of {limit}); a script that calls eddis.resume() continues from its last checkpoint", sys.stderr)
        return True

    def _place_without_failed_nodes(self):
        """Ask Slurm which of the job's nodes failed and plan the next attempt without them;
        False (and why, on stderr) when too few healthy nodes remain."""
        from .. import settings
        from ..slurm.nodes import job_node_lists, node_health

        if not self.nodes_started:
            return True
        lists = job_node_lists(self.job_id)
        health = node_health(",".join(self.nodes_started))
        if lists is None or health is None:
            say("eddis_job: Slurm did not say which of the job's nodes are healthy (scontrol show job/node "
                "failed); the restart uses the same nodes", sys.stderr)
            return True
        current = {n for text in lists for n in expand_hostlist(text)}
        failed = placement.failed_nodes(self.nodes_started, current, health)
        if not failed:
            return True
        try:
            self.placement = placement.plan(self.nodes_started, settings.get("EDDIS_SPARE_NODES"),
                                            None if self.placement is None else self.placement.tasks_per_node,
                                            failed, self.batch_host)
        except NodeFailureError as exc:
            say(f"eddis_job: error: {exc}", sys.stderr)
            return False
        say(f"eddis_job: node(s) {'; '.join(failed.values())} failed: the smb-servers and trainers restart on "
            f"{','.join(self.placement.nodes)}, without {', '.join(failed)}", sys.stderr)
        return True

    def _attempt(self):
        """One run of the job's steps: the servers, the trainers, the servers' end, the report."""
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
            return 1
        status = self._train()
        end_server_steps(self.run_dir, self.servers)
        if elastic_run():
            # after the servers' end: a server that left no record of it was lost with its node
            status = elastic_status(self.run_dir, status, sys.stderr)
        if status == 0:
            from ..smb.rundir import checkpoint_answer, training_was_complete

            self.answer = checkpoint_answer(self.run_dir)
            if training_was_complete(self.run_dir):
                say(f"eddis_job: {jobsteps.COMPLETE_BEFORE_CHECKPOINT}")
            if self.answer is None:
                jobsteps.remove_elastic_commits(self.run_dir)
        if status != 0 and root_cause(self.run_dir)[0] is None and (
                status == INTERRUPTED_STATUS or jobsteps.every_rank_interrupted(self.run_dir)):
            # scancel --signal=INT reached the trainers' step itself: no rank failed
            say("eddis_job: the trainers were interrupted (SIGINT)", sys.stderr)
            status = INTERRUPTED_STATUS
        elif status != 0:
            # srun's own status may be a peer's SIGKILL; the root cause's is the job's
            status, _ = jobsteps.report_failure(self.run_dir, status)
        return status

    def _train(self):
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
        status = trainers_status(self.run_dir, status)
        if status > 128 and jobsteps.every_rank_finished(self.run_dir):
            say(f"eddis_job: srun {jobsteps.describe_exit(None, status - 128)} "
                "after every rank had finished the training: srun failed at the step's end, not the "
                "training; the job goes on as finished", sys.stderr)
            return 0
        missing = jobsteps.ranks_without_exit(self.run_dir) if status == 0 and not elastic_run() else []
        if missing:
            say(f"eddis_job: srun ended with status 0, but rank(s) {', '.join(map(str, missing))} recorded no "
                "exit (Slurm ends the tasks on a failed node without one): the trainers failed", sys.stderr)
            return 1
        return status

    def _wait_trainers(self):
        """The trainers' status; bounded by the trainer guard, the server steps and the job's time limit."""
        survivable = survives_server_loss()
        noted = set()
        while True:
            if self.trainer.poll() is not None:
                return exit_status(self.trainer.returncode)
            if self.signals.checkpoint_asked and not self.checkpoint_requested:
                self._request_checkpoint()
            ended = [p for p in self.servers if p.poll() is not None]
            if ended and server_steps_end_training(len(ended), len(self.servers), survivable):
                say(f"eddis_job: an smb-server step ended (status {exit_status(ended[0].returncode)}) "
                    "during training; stopping the trainers", sys.stderr)
                self._stop_trainers(f"an smb-server step ended (status {exit_status(ended[0].returncode)})")
                return 1
            for step in (p for p in ended if p.pid not in noted):
                noted.add(step.pid)   # a hetjob component's servers, lost with its node(s)
                say(f"eddis_job: an smb-server step ended (status {exit_status(step.returncode)}) during "
                    "training; elastic run with mirrored state: the trainers go on", sys.stderr)
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
        say("eddis_job: the time limit is near (SIGUSR1 from Slurm): asking the trainers for a checkpoint")

    def _checkpoint_written(self):
        """"checkpoint <path> (step <n>)" that the trainers wrote before they stopped, or None."""
        if self.answer is None:
            return None
        return f"checkpoint {self.answer.get('checkpoint')} (step {self.answer.get('step')})"

    def _requeue(self, preempted=False):
        """The trainers wrote the checkpoint they were asked for and stopped, or Slurm preempted
        the job (``preempted``; with or without a checkpoint): queue the job again."""
        from .. import settings

        where = self._checkpoint_written()
        what = f"wrote {where}" if where else "no checkpoint was written (that takes EDDIS_CHECKPOINT_DIR " \
                                              "and a step boundary within the grace time)"
        if preempted:
            say(f"eddis_job: preempted by Slurm: {what}")
        if not settings.get("EDDIS_REQUEUE"):
            say(f"eddis_job: the trainers stopped ({what}); EDDIS_REQUEUE=0, so the job ends here: "
                "resubmit it to resume")
            return 0
        restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        own = restarts - preemption.preemptions(self.run_dir)
        limit = settings.get("EDDIS_MAX_REQUEUES")
        if not preempted and own >= limit:
            say(f"eddis_job: error: the trainers stopped after writing {where}, but the job has requeued "
                f"itself {own} times (EDDIS_MAX_REQUEUES={limit}); not requeued again: raise "
                "EDDIS_MAX_REQUEUES or the time limit, and resubmit to resume", sys.stderr)
            return 1
        # counted first: Slurm ends this script soon after the requeue
        count = preemption.count_preemption(self.run_dir) if preempted else None
        try:
            proc = subprocess.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True,
                                  timeout=SLURM_COMMAND_TIMEOUT)
            failure = None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            failure = str(exc)
        if failure is not None:
            say(f"eddis_job: error: the trainers stopped ({what}), but `scontrol requeue {self.job_id}` failed: "
                f"{failure}. Submit with --requeue (the script's #SBATCH --requeue), or resubmit the job to "
                "resume", sys.stderr)
            return 1
        if preempted:
            say(f"eddis_job: requeued job {self.job_id} (run {restarts + 2}; preemption {count}, not counted "
                "against EDDIS_MAX_REQUEUES) now, not at the end of Slurm's grace time; it "
                f"{'resumes there' if where else 'resumes from its last checkpoint, if any,'} when Slurm runs it again")
            return 0
        say(f"eddis_job: wrote {where}; requeued job {self.job_id} (run {restarts + 2}), which resumes there")
        return 0

    def _retire(self):
        from ..smb.rundir import retire_run_dir

        retire_run_dir(self.run_dir)  # the token must not outlive the job


def run_job(train):
    """``eddis-train --job``: run the job, return its exit status."""
    return Job(train).run()

