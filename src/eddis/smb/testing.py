"""Start real smb-server processes on this machine (tests, benchmarks, examples).

    with LocalServers(2, memory="64M") as servers:
        client = Client(servers.run_dir, expected_servers=2)

Each server is a separate ``smb-server`` process (``python -m eddis.smb.server``)
with its own fake node name (``EDDIS_HOSTNAME=<prefix><i>``) unless
``same_node=True``; stop() sends SIGTERM and checks nothing is left behind.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import SMBServerError
from . import rundir


def _env(extra=None):
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def _die_with_parent():
    """In the child: get SIGTERM when the test process dies, so no server is orphaned."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalServers:
    def __init__(self, count, memory="64M", run_dir=None, env=None, hostnames=None, timeout=30):
        self.count = count
        self.memory = memory
        self._own_dir = run_dir is None
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="eddis-smb-test-"))
        self.env = env or {}
        self.hostnames = hostnames
        self.timeout = timeout
        self.procs = []
        self.records = []
        self.leftovers = []
        self.hung = []          # servers that needed SIGKILL after SIGTERM
        self.killed = []        # servers the test killed itself
        self.unpublished = []   # servers whose address file survived a clean stop

    def start(self):
        rundir.create_run_dir(self.run_dir)
        try:
            for i in range(self.count):
                extra = dict(self.env)
                if self.hostnames is not None:
                    extra["EDDIS_HOSTNAME"] = self.hostnames[i]
                argv = [sys.executable, "-m", "eddis.smb.server", "--run-dir", str(self.run_dir),
                        "--index", str(i), "--memory", str(self.memory), "--host", "127.0.0.1"]
                self.procs.append(subprocess.Popen(argv, env=_env(extra), stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.PIPE, text=True,
                                                   preexec_fn=_die_with_parent))
            self.records = rundir.wait_for_servers(self.run_dir, self.count, self.timeout,
                                                   check=self._none_exited)
        except BaseException:
            self.stop()
            raise
        return self

    def _none_exited(self):
        """Raise, with its stderr, for a server that exited before publishing."""
        for index, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise SMBServerError(f"smb-server {index} exited with {proc.returncode} before "
                                     f"publishing:\n{proc.stderr.read()[-3000:]}")

    def kill(self, index, sig=signal.SIGKILL):
        self.killed.append(index)
        self.procs[index].send_signal(sig)
        self.procs[index].wait(10)

    def stop(self):
        """SIGTERM every server; returns their stderr texts."""
        errors = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for index, proc in enumerate(self.procs):
            try:
                _, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                self.hung.append(index)  # did not exit on SIGTERM: a bug the tests report
                proc.kill()
                _, err = proc.communicate()
            errors.append(err)
        for index in range(len(self.procs)):
            if rundir.server_file(self.run_dir, index).exists() and index not in self.killed:
                self.unpublished.append(index)
        self.procs = []
        # Servers unlink their arena right after creating it; anything here is a bug.
        from .server import arena_name

        self.leftovers = []
        for i in range(self.count):
            for path in Path("/dev/shm").glob(arena_name(self.run_dir, i).lstrip("/") + "-*"):
                self.leftovers.append(str(path))
                path.unlink()
        if self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return errors

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
