"""What happens when a child finds its supervisor hung (:mod:`.liveness`): the supervisor's
verdict on itself, handed to its child at the start, and the child's carrying it out.

A supervisor names the failure it would be, as it names a hung child: the records that make
it the root cause (``the eddis-train supervisor of rank 2 on host n2 (pid P) hung``), whether
the run dir's ranks must stop (a server's), and how its child stops itself first (an
smb-server frees its shared memory). The child, which alone can still act on that node,
writes them and kills the supervisor, which takes the child with it.
"""
import os
import signal
import time

# the status a supervisor found hung ends with: it is killed, as a hung child is
HUNG_SIGNAL = signal.SIGKILL
SUPERVISOR_KIND = "eddis-train supervisor"   # how the report names a rank's or a server's
# a child that stops itself cleanly after its supervisor was found hung (end_hung_parent)
STOP_SELF_SECONDS = 10.0


def end_hung_parent(verdict, pid, why):
    """Carry out a supervisor's verdict on itself, found hung by its child: write its records
    (``verdict["records"]``: paths, each given ``verdict["record"]`` with the time and why),
    ask every rank of ``verdict["stop_run_dir"]`` to stop where given, kill the supervisor.
    ``verdict["lost_if_exists"]``: an elastic rank's training-started file; the rank counts
    as lost (its peers train on) once it exists.

    The child dies with its supervisor (PR_SET_PDEATHSIG; else of the same signal here), at
    once, unless ``verdict["stop_signal"]`` names the signal of its own clean stop (an
    smb-server frees its shared memory): then it gets that first, and the supervisor is killed
    as the child exits, or STOP_SELF_SECONDS later."""
    import atexit

    from .report import describe_failure, request_stop, write_json_atomic

    record = dict(verdict["record"], time=time.time(), why="hung", hung=why, signal=int(HUNG_SIGNAL), code=None)
    if verdict.get("lost_if_exists"):
        record["lost"] = os.path.exists(verdict["lost_if_exists"])
    try:
        for path in verdict["records"]:
            write_json_atomic(path, record)
        if verdict.get("stop_run_dir"):
            request_stop(verdict["stop_run_dir"], describe_failure(record))
    except OSError:
        pass  # a full or failing file system: the supervisor's death still ends its part of the job

    def kill_supervisor():
        try:
            os.kill(pid, HUNG_SIGNAL)
        except OSError:
            pass

    if verdict.get("stop_signal"):
        atexit.register(kill_supervisor)
        os.kill(os.getpid(), signal.Signals[verdict["stop_signal"]])
        time.sleep(STOP_SELF_SECONDS)
    kill_supervisor()
    time.sleep(1.0)  # PR_SET_PDEATHSIG has ended this process by now; unsupervised, it must not go on
    os.kill(os.getpid(), HUNG_SIGNAL)


def supervisor_verdict(records, key, record, stop_run_dir=None, lost_if_exists=None, stop_signal=None):
    """The verdict a supervisor hands its child (:func:`end_hung_parent`): ``record`` as its
    failure and its exit under ``records`` (a :class:`~.report.LaunchRecords`), file ``key``."""
    return {"records": [str(records.failures / f"{key}.json"), str(records.exits / f"{key}.json")],
            "record": dict(record, supervisor=SUPERVISOR_KIND, pid=os.getpid()),
            "stop_run_dir": None if stop_run_dir is None else str(stop_run_dir),
            "lost_if_exists": None if lost_if_exists is None else str(lost_if_exists),
            "stop_signal": None if stop_signal is None else signal.Signals(stop_signal).name}
