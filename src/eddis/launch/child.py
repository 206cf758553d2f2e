"""Runs the user's training script inside the trainer process (``python -m eddis.launch.child``).

The one thing it adds to ``python train.py``: an uncaught exception (or a
non-zero ``sys.exit``) ends the process at once with ``os._exit`` after the
traceback is printed and the streams flushed. A plain Python exit would call
``MPI_Finalize`` at interpreter shutdown, which waits for the peers, while the
peers wait in a collective for this rank: the job would hang instead of failing.
(``python -m mpi4py`` solves the same problem with ``MPI_Abort``; we exit instead,
so the supervisor records this rank as the root cause rather than the abort.)
Before the script runs, the process starts beating to its supervisor
(:mod:`.liveness`), which names it when it stops making progress, and enables
:mod:`faulthandler`: a rank that dies of SIGSEGV, SIGBUS, SIGFPE, SIGILL or SIGABRT
prints every thread's Python stack, which the launcher's report quotes with the
lines of the native backtrace (faulthandler goes over UCX's handler, installed when
the SMB core loads, and passes the signal on to it once it has written).

One interrupt is one KeyboardInterrupt: Slurm delivers a step's signal to every
process of the step (``scancel --signal=INT``; proctrack), so the trainer gets SIGINT
from slurmstepd and again from its supervisor, which passes it on. A second SIGINT
within DUPLICATE_INTERRUPT_SECONDS of the first is that same interrupt and is dropped,
so that it cannot break into the script's own ``except KeyboardInterrupt``; a later one
interrupts again, as in plain Python. A script that installs its own SIGINT handler
replaces this one. SIGINT, SIGTERM and SIGUSR1 are unblocked first, whatever mask the
process inherited.
"""
import faulthandler
import os
import runpy
import signal
import sys
import time
import traceback

from .liveness import start_in_child
from .status import INTERRUPTED_STATUS

DUPLICATE_INTERRUPT_SECONDS = 2.0
# what a job sends its trainers: an interrupt, the end, a checkpoint request (Slurm's warning)
SIGNALS_TO_TAKE = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1}
_interrupted_at = [None]


def _interrupt_once(signum, frame):
    now = time.monotonic()
    if _interrupted_at[0] is not None and now - _interrupted_at[0] < DUPLICATE_INTERRUPT_SECONDS:
        return
    _interrupted_at[0] = now
    signal.default_int_handler(signum, frame)  # Python's own: raises KeyboardInterrupt

def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not hide the exit code
            pass


def _exit_now(code):
    _flush()
    os._exit(code)


def _user_frames(tb):
    """Skip this runner's and runpy's frames: the traceback starts in the user's script."""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename != __file__ and filename != runpy.__file__ and not filename.startswith("<frozen runpy"):
            return tb
        tb = tb.tb_next
    return tb


def _enable_faulthandler():
    """Python's stacks on a fatal signal, then UCX's native backtrace: UCX installs its own
    handler when the SMB core loads and passes nothing on, so the core loads first and
    faulthandler, which calls the handler it replaced once it has written, goes over it."""
    faulthandler.disable()  # (PYTHONFAULTHANDLER, which the supervisor sets, enabled it)
    import eddis.smb._core  # noqa: F401

    faulthandler.enable(all_threads=True)


def main():
    # a blocked signal mask survives fork and exec: a trainer started by a process (or thread)
    # that blocked these would leave scancel's interrupt and Slurm's warning pending forever
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS_TO_TAKE)
    _enable_faulthandler()
    start_in_child()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_once)
    argv = sys.argv[1:]
    if not argv:
        print("usage: python -m eddis.launch.child (SCRIPT.py | -m MODULE) [args]", file=sys.stderr)
        return 2
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        _exit_now(code)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: report and leave
        traceback.print_exception(type(exc), exc, _user_frames(exc.__traceback__))
        # an uncaught interrupt ends with the status a shell gives a process ended by SIGINT
        _exit_now(INTERRUPTED_STATUS if isinstance(exc, KeyboardInterrupt) else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
