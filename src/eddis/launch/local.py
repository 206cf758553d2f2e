"""``eddis-train --local -n N train.py``: the whole job on one machine, no Slurm.

Creates a run directory with its token, starts one ``smb-server`` and waits until
it has published, runs N ranks with Open MPI's ``mpirun`` (each rank is an
``eddis-train`` supervisor, as under srun), then stops the server and prints the
root-cause report when a rank failed. SIGTERM stops everything. Ctrl-C (SIGINT)
interrupts: every trainer gets SIGINT, so that the script's ``except
KeyboardInterrupt`` runs, then SIGTERM after ``EDDIS_INTERRUPT_GRACE`` s and SIGKILL
after ``EDDIS_STOP_GRACE`` s more (a second Ctrl-C cuts that short); the run exits 130.
Slurm's variables are removed from the ranks' environment, so this also works
inside an allocation without joining it.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from .. import settings
from ..errors import REQUEUE_EXIT_STATUS, ConfigError
from ..smb import rundir
from . import jobsteps
from .elastic import MPIRUN_OPTIONS, elastic_run, elastic_status
from .report import LAUNCH_DIR, STOP_FILE, format_report, request_stop, root_cause
from .status import exit_status, run_status
from .topwatch import TopWatch

SERVER_STOP_SECONDS = 10.0
_STRIPPED_PREFIXES = ("SLURM_", "SLURMD_", "PMIX_", "PMI_", "OMPI_COMM_WORLD_")


def _clean_environment():
    return {k: v for k, v in os.environ.items() if not k.startswith(_STRIPPED_PREFIXES)}


def server_command(run_dir, memory):
    """The smb-server under its supervisor, which names it when it dies or hangs."""
    from .serverstep import supervisor_command

    return supervisor_command(run_dir, 0, memory)


def mpirun_command(ranks, argv, elastic=False):
    if shutil.which("mpirun") is None:
        raise ConfigError("mpirun is not on PATH: install Open MPI (apt-get install openmpi-bin) "
                          "or load its module, then retry eddis-train --local")
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"]
    if elastic:
        cmd.extend(MPIRUN_OPTIONS)
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + [sys.executable, "-m", "eddis.launch.train", *argv]


def _stop(proc, sig=signal.SIGTERM, timeout=SERVER_STOP_SECONDS):
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def run_local(argv, ranks=1, memory=None):
    if ranks < 1:
        raise ConfigError(f"-n {ranks}: give at least one rank")
    # stopped or wedged, this process would keep the server for ever: its sentinel ends the run then
    with TopWatch("eddis-train --local", jobsteps.run_dir()):
        return _run_attempts(argv, ranks, memory)


def _run_attempts(argv, ranks, memory):
    limit = settings.get("EDDIS_MAX_RESTARTS")
    restarts = 0
    while True:
        code, signalled = _launch(argv, ranks, memory, restarts)
        if code in (0, REQUEUE_EXIT_STATUS) or signalled or limit <= 0:
            return code
        if restarts >= limit:
            print(f"eddis-train: the ranks failed again after {restarts} restart(s) "
                  f"(EDDIS_MAX_RESTARTS={limit}); giving up", file=sys.stderr, flush=True)
            return code
        restarts += 1
        print(f"eddis-train: restarting the smb-server and the ranks (restart {restarts} of {limit}); a "
              "script that calls eddis.resume() continues from its last checkpoint", file=sys.stderr, flush=True)


def _launch(argv, ranks, memory, restarts):
    """One run of the server and the ranks: (exit status, whether a signal stopped it)."""
    stop_signal = []  # the signals this run received, filled by its handler
    code = _launch_once(argv, ranks, memory, restarts, stop_signal)
    return code, bool(stop_signal)


def _launch_once(argv, ranks, memory, restarts, stop_signal):
    elastic = elastic_run()
    run_dir = jobsteps.create_run_dir(jobsteps.run_dir())
    shutil.rmtree(run_dir / LAUNCH_DIR, ignore_errors=True)  # records of an earlier run in this dir
    _remove_dead_server_files(run_dir)
    env = _clean_environment()
    env["EDDIS_RUN_DIR"] = str(run_dir)
    env["EDDIS_RESTART_COUNT"] = str(restarts)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    if os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

    def on_signal(signum, frame):
        stop_signal.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    server = mpirun = None
    stop_file = run_dir / LAUNCH_DIR / STOP_FILE
    try:
        print(f"eddis-train: run dir {run_dir}; starting smb-server", file=sys.stderr, flush=True)
        # Own sessions: a Ctrl-C reaches only us; we stop the ranks and then the server in order.
        server = subprocess.Popen(server_command(run_dir, memory), env=env, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        if jobsteps.wait_servers(run_dir, 1, watch_pids=[server.pid]) != 0:
            return 1
        if stop_signal:
            return 128 + stop_signal[0]
        mpirun = subprocess.Popen(mpirun_command(ranks, argv, elastic), env=env, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        stop_deadline = None
        while True:
            try:
                code = mpirun.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            if stop_signal and stop_deadline is None:
                # The supervisors watch this file and stop their trainers gracefully; mpirun
                # then ends by itself. SIGTERM to mpirun only if that takes too long.
                interrupted = stop_signal[0] == signal.SIGINT
                name = signal.Signals(stop_signal[0]).name
                request_stop(run_dir, f"eddis-train --local received {name}",
                             signal.SIGINT if interrupted else signal.SIGTERM)
                if interrupted:
                    print("eddis-train: interrupted (SIGINT): every trainer gets SIGINT (KeyboardInterrupt), "
                          f"SIGTERM after {settings.get('EDDIS_INTERRUPT_GRACE'):g} s "
                          "(EDDIS_INTERRUPT_GRACE); Ctrl-C again to stop them now", file=sys.stderr, flush=True)
                stop_deadline = (time.monotonic() + settings.get("EDDIS_STOP_GRACE") + 10
                                 + (settings.get("EDDIS_INTERRUPT_GRACE") if interrupted else 0))
            elif len(stop_signal) > 1 and stop_deadline != float("inf"):
                mpirun.send_signal(signal.SIGTERM)   # a second signal: stop now
                stop_deadline = float("inf")
            elif stop_deadline is not None and time.monotonic() > stop_deadline:
                mpirun.send_signal(signal.SIGTERM)
                stop_deadline = float("inf")
            if stop_deadline is None and server.poll() is not None:
                print(f"eddis-train: error: the smb-server ended (status {server.returncode}) while "
                      "training; stopping the ranks", file=sys.stderr, flush=True)
                request_stop(run_dir, f"the smb-server ended (status {server.returncode})")
                code = _wait_or_kill(mpirun, settings.get("EDDIS_STOP_GRACE") + 10)
                code = code or 1
                break
        code = exit_status(code)
        if stop_signal:
            what = "interrupted" if stop_signal[0] == signal.SIGINT else "stopped"
            print(f"eddis-train: {what} by {signal.Signals(stop_signal[0]).name}; the ranks have ended "
                  f"(exit status {128 + stop_signal[0]})", file=sys.stderr, flush=True)
            return 128 + stop_signal[0]
        answer = rundir.checkpoint_answer(run_dir) if code == 0 else None
        if code == 0 and rundir.training_was_complete(run_dir):
            print(f"eddis-train: {jobsteps.COMPLETE_BEFORE_CHECKPOINT}", file=sys.stderr, flush=True)
        if code == 0 and answer is None:
            jobsteps.remove_elastic_commits(run_dir)
        if answer is not None:
            print(f"eddis-train: the ranks stopped after writing the requested checkpoint {answer['checkpoint']} "
                  f"(step {answer['step']}); run the same command again to resume from it (exit status "
                  f"{REQUEUE_EXIT_STATUS})", file=sys.stderr, flush=True)
            return REQUEUE_EXIT_STATUS
        if elastic:
            code = elastic_status(run_dir, code, sys.stderr, servers_ended=False)   # it runs on
        if code != 0:
            first, failures, exits = root_cause(run_dir)
            print(format_report(first, failures, exits, run_dir=run_dir, job_code=code),
                  file=sys.stderr, flush=True)
            code = run_status(first, code)  # the root cause's status, not the first stopped peer's
        return code
    finally:
        _stop(mpirun, signal.SIGTERM, timeout=settings.get("EDDIS_STOP_GRACE") + 10)
        _stop(server)
        stop_file.unlink(missing_ok=True)
        if server is None or server.poll() is not None:
            rundir.retire_run_dir(run_dir)   # the token must not outlive the job
        for s, handler in previous.items():
            signal.signal(s, handler)


def _remove_dead_server_files(run_dir):
    """Address files left by servers that were killed: the wait must not take them for ours."""
    for path in (run_dir / "servers").glob("*.json"):
        try:
            pid = int(json.loads(path.read_text()).get("pid", 0))
        except (OSError, ValueError, AttributeError):
            pid = 0
        if pid <= 0 or not jobsteps.process_alive(pid):
            path.unlink(missing_ok=True)


def _wait_or_kill(proc, timeout=30.0):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=timeout)
