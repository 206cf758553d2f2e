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

from ..errors import ConfigError, JobSignalled
from . import jobsteps, placement, preemption
from .allocation import components, job_nodes
from .elastic import elastic_run, elastic_status, survives_server_loss
from .jobsignals import CHECKPOINT_SIGNAL, JobSignals
from .jobsteps import TRAINER_STEP_NAME, trainers_status
from .report import describe_failure, request_servers_stop, request_stop, root_cause, start_up_crash
from .status import INTERRUPTED_STATUS, SIGNALLED_STATUS, exit_status
from .stepcommands import (SERVER_STEP_NAME, launched_by_mpirun, server_count, server_step_command,
                           server_steps_end_training, trainer_step_command)
from .stepcontrol import (POLL_SECONDS, SLURM_COMMAND_TIMEOUT, end_server_steps, running, scancel, start_step,
                          stop_mpirun, stop_steps, wait_ended)
from .topwatch import TopWatch

# for the sruns to end once Slurm signalled the job; Slurm's KillWait (30 s by default) ends the rest
SIGNAL_WAIT_SECONDS = 30.0
GUARD_JOIN_SECONDS = 15.0  # the guard may be inside one squeue call when srun ends


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
        self.placement = placement.first_placement(self.nodes_started, self.components, os.environ,
                                                   self.batch_host)
        self.signals = JobSignals()
        self.run_dir = None
        self.servers = []
        self.trainer = None
        self.trainer_by_mpirun = False   # an elastic run's mpirun, not srun (trainer_step_command)
        self.checkpoint_requested = False  # passed on to the trainers
        self.answer = None  # the checkpoint the trainers wrote on request, then stopped
        self.topwatch = None  # this process's sentinel (.topwatch), once the run dir exists

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
        self.placement, enough = placement.without_failed_nodes(
            self.job_id, self.nodes_started, self.placement, self.batch_host,
            lambda text: say(f"eddis_job: {text}", sys.stderr))
        if not enough:
            return False
        say(f"eddis_job: restarting the smb-servers and trainers in this allocation (restart {restarts + 1} "
            f"of {limit}); a script that calls eddis.resume() continues from its last checkpoint", sys.stderr)
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

