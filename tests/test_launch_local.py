"""`eddis-train --local`: a real smb-server and real Open MPI ranks on this machine, no Slurm."""
import os
import re
import signal
import subprocess
import time

import pytest
pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

from conftest import PYTHON, REPO, python_env, run_process_group
from launch_helpers import TRAINER, make_bin, processes_with_env, shm_leftovers

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)


SLURM_COMMANDS = ("srun", "sbatch", "salloc", "scontrol", "sinfo", "squeue", "scancel")


def slurm_tripwires(directory, log):
    """Slurm's commands, replaced by ones that log their use and fail: --local must not need any."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in SLURM_COMMANDS:
        path = directory / name
        path.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {log}\nexit 1\n")
        path.chmod(0o755)
    return directory


def local_env(tmp_path):
    bin_dir = make_bin(tmp_path / "bin")
    no_slurm = slurm_tripwires(tmp_path / "no-slurm", tmp_path / "slurm-calls.log")
    return python_env({
        "PATH": f"{bin_dir}:{no_slurm}:{os.environ['PATH']}",
        "EDDIS_RUN_DIR": str(tmp_path / "run"),
        "SMB_MEMORY": "64M",
        # Nothing of Slurm may be needed: a config that does not exist, and the variables of an
        # enclosing job, which --local must drop (or mpirun would try to join that job).
        "SLURM_CONF": "/nonexistent/slurm.conf",
        # (a batch script's environment: SLURM_PROCID without SLURM_STEP_ID, so not an srun task)
        "SLURM_JOB_ID": "999999", "SLURM_PROCID": "0", "SLURM_NODELIST": "n1",
    })


def eddis_train(tmp_path, *args, timeout=120, env=None):
    return run_process_group(["eddis-train", *map(str, args)], dict(local_env(tmp_path), **(env or {})), timeout,
                             cwd=str(REPO))


def assert_clean(tmp_path):
    run_dir = tmp_path / "run"
    calls = tmp_path / "slurm-calls.log"
    assert not calls.exists(), f"--local used Slurm: {calls.read_text()}"
    assert processes_with_env("EDDIS_RUN_DIR", str(run_dir)) == []
    launches = [p.name for p in (run_dir / "launch").iterdir()]
    assert launches, "no launch records were written"
    for key in launches:
        assert shm_leftovers(run_dir, f"eddis-{key}-") == []
    assert list((run_dir / "servers").glob("*.json")) == []


@pytest.mark.timeout(180)
def test_local_two_ranks(tmp_path):
    proc = eddis_train(tmp_path, "--local", "-n", "2", TRAINER, "--steps", "3", "--no-newline-at-end")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}@\S+\] eddis-train: rank {rank}/2 local {rank}/2 group 0/1 .* gpu cpu",
                         proc.stdout, re.M)
        env_line = re.search(rf"^\[{rank}@\S+\] ENV (.*)$", proc.stdout, re.M).group(1)
        assert f"EDDIS_RANK={rank} EDDIS_SIZE=2 EDDIS_LOCAL_RANK={rank} EDDIS_LOCAL_SIZE=2" in env_line
        assert f"MPI_RANK={rank} MPI_SIZE=2" in env_line and f"EDDIS_RUN_DIR={tmp_path / 'run'}" in env_line
        assert f"[{rank}@" in proc.stderr and f"warning line from rank {rank}" in proc.stderr
        # the last line has no newline and still arrives, prefixed, whole
        assert re.search(rf"^\[{rank}@\S+\] DONE$", proc.stdout, re.M)
    # every line of the ranks carries the prefix
    for line in proc.stdout.splitlines():
        assert line.startswith("[") or line.startswith("smb-server") or line.startswith("eddis-train:"), line
    assert_clean(tmp_path)


@pytest.mark.timeout(180)
def test_local_rank_exception_fails_fast_with_report(tmp_path):
    proc = eddis_train(tmp_path, "--local", "-n", "2", TRAINER, "--steps", "500", "--step-seconds", "0.1",
                       "--fail-rank", "1", "--fail-step", "3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = proc.stderr[proc.stderr.index("ROOT CAUSE"):]
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ exited with code 1", report)
    assert "RuntimeError: injected failure on rank 1 at step 3" in report
    assert 'mpi_trainer.py", line' in report and "child.py" not in report
    assert "stopped by the launcher: rank 0" in report
    assert "step 499" not in proc.stdout  # rank 0 was stopped, not left to finish
    assert_clean(tmp_path)


@pytest.mark.timeout(180)
def test_a_rank_killed_by_sigsegv_is_reported_with_its_python_stack(tmp_path):
    # mpi_trainer.py never calls eddis.init(): its crash would be a start-up crash, started again once
    proc = eddis_train(tmp_path, "--local", "-n", "2", TRAINER, "--steps", "500", "--step-seconds", "0.1",
                       "--fail-rank", "1", "--fail-step", "2", "--how", "segfault", env={"EDDIS_START_RETRIES": "0"})
    assert proc.returncode == 128 + signal.SIGSEGV, proc.stdout + proc.stderr
    report = proc.stderr[proc.stderr.index("ROOT CAUSE"):]
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ was killed by signal 11 \(SIGSEGV\)", report), report
    stack = report[report.index("its Python stack at the fatal signal (rank 1):"):]
    assert re.search(r"^    Fatal Python error: Segmentation fault\n    Current thread 0x[0-9a-f]+ \(most recent "
                     r"call first\):\n      File \"\S+mpi_trainer\.py\", line \d+ in fail\n", stack, re.M), report
    # then the native handler's backtrace, not the stacks again
    tail = stack[stack.index("last lines of rank 1's stderr:"):]
    assert "Caught signal 11" in tail and "Current thread" not in tail, report
    assert "stopped by the launcher: rank 0" in report
    assert_clean(tmp_path)


@pytest.mark.timeout(180)
def test_local_sys_exit_code_is_the_jobs_code(tmp_path):
    proc = eddis_train(tmp_path, "--local", "-n", "2", TRAINER, "--steps", "500", "--step-seconds", "0.1",
                       "--fail-rank", "0", "--fail-step", "2", "--how", "exit")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert re.search(r"ROOT CAUSE: rank 0 on host \S+ exited with code 3", proc.stderr)
    assert_clean(tmp_path)


@pytest.mark.timeout(120)
def test_without_local_and_launcher_runs_one_rank(tmp_path):
    proc = eddis_train(tmp_path, TRAINER, "--steps", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^\[0@\S+\] eddis-train: rank 0/1 ", proc.stdout, re.M)
    assert_clean(tmp_path)


@pytest.mark.timeout(60)
def test_bad_usage_is_explained(tmp_path):
    proc = eddis_train(tmp_path, "--local", "-n", "2")
    assert proc.returncode == 2 and "give the training script" in proc.stderr
    env = local_env(tmp_path)
    env["EDDIS_STOP_GRACE"] = "soon"
    bad = subprocess.run(["eddis-train", "--local", str(TRAINER)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "EDDIS_STOP_GRACE='soon' is not a valid float" in bad.stderr


@pytest.mark.timeout(300)
def test_local_pytorch_example(tmp_path):
    example = REPO / "examples" / "torch_train.py"
    import torch  # noqa: F401  (required: missing is a failure, not a skip)
    import sklearn  # noqa: F401  (required: missing is a failure, not a skip)
    # a server file of an earlier, killed run in the same run dir must not be taken for the new server
    servers = tmp_path / "run" / "servers"
    servers.mkdir(parents=True)
    (servers / "0.json").write_text('{"index": 0, "hostname": "x", "host": "127.0.0.1", "port": 9, "pid": 999999999}')
    proc = eddis_train(tmp_path, "--local", "-n", "2", example, "--epochs", "2", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"^\[0@\S+\] epoch +\d+ +train loss ([\d.]+)", proc.stdout, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], proc.stdout
    assert re.search(r"^\[0@\S+\] ranks 2  mode sync ", proc.stdout, re.M), proc.stdout
    assert_clean(tmp_path)


@pytest.mark.timeout(120)
def test_usr1_reaches_the_trainer_without_stopping_it(tmp_path):
    script = tmp_path / "usr1.py"
    script.write_text(
        "import signal, sys, time\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\n"
        "print('ready', flush=True)\n"
        "deadline = time.time() + 60\n"
        "while not got and time.time() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print('checkpoint on USR1' if got else 'no USR1', flush=True)\n"
        "sys.exit(0 if got else 1)\n")
    env = local_env(tmp_path)
    env.update({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})  # one supervised rank, no mpirun
    sup = subprocess.Popen(["eddis-train", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "eddis-train: rank 0/1" in sup.stdout.readline()
        assert sup.stdout.readline().strip().endswith("ready")
        sup.send_signal(__import__("signal").SIGUSR1)
        out, _ = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
    assert sup.returncode == 0 and "checkpoint on USR1" in out


INTERRUPTIBLE = REPO / "tests" / "launch_scripts" / "interruptible_trainer.py"


def _interrupt_local_run(tmp_path, *script_args, env=None):
    """eddis-train --local -n 2 with the interruptible trainer; Ctrl-C (SIGINT to the foreground
    process group) once both ranks step. Returns (exit status, output)."""
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen(["eddis-train", "--local", "-n", "2", str(INTERRUPTIBLE), str(tmp_path),
                                 *script_args], env=dict(local_env(tmp_path), **(env or {})), cwd=str(REPO),
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            while not all(re.search(rf"^\[{r}@\S+\] step 3$", out.read_text(), re.M) for r in (0, 1)):
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return code, out.read_text()


@pytest.mark.timeout(180)
def test_ctrl_c_runs_every_ranks_keyboard_interrupt_handler(tmp_path):
    code, text = _interrupt_local_run(tmp_path)
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}@\S+\] rank {rank}: caught KeyboardInterrupt", text, re.M), text
        assert re.search(rf"^\[{rank}@\S+\] rank {rank}: saved$", text, re.M), text
        assert (tmp_path / f"interrupted.{rank}").exists(), text
    assert code == 130, text
    assert "eddis-train: interrupted by SIGINT" in text, text
    assert "ROOT CAUSE" not in text and "sending SIGTERM" not in text, text
    assert "never interrupted" not in text
    assert_clean(tmp_path)


@pytest.mark.timeout(180)
def test_ctrl_c_goes_on_to_sigterm_when_the_trainer_ignores_sigint(tmp_path):
    code, text = _interrupt_local_run(tmp_path, "--ignore-sigint", env={"EDDIS_INTERRUPT_GRACE": "2"})
    assert code == 130, text
    assert re.search(r"did not end within 2 s of SIGINT \(EDDIS_INTERRUPT_GRACE\); sending SIGTERM", text), text
    assert "caught KeyboardInterrupt" not in text and "never interrupted" not in text
    assert "ROOT CAUSE" not in text
    assert_clean(tmp_path)


@pytest.mark.timeout(180)
def test_ctrl_c_stops_everything(tmp_path):
    """Ctrl-C in a terminal: SIGINT to the whole foreground process group."""
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen(["eddis-train", "--local", "-n", "2", str(TRAINER), "--steps", "3000",
                                 "--step-seconds", "0.1"], env=local_env(tmp_path), cwd=str(REPO),
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = __import__("time").monotonic() + 90
            while not re.search(r"^\[1@\S+\] step 2 ", out.read_text(), re.M):
                assert proc.poll() is None and __import__("time").monotonic() < deadline, out.read_text()
                __import__("time").sleep(0.2)
            os.killpg(proc.pid, __import__("signal").SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, __import__("signal").SIGKILL)
    text = out.read_text()
    assert code != 0, text
    assert "ROOT CAUSE" not in text  # an interrupt is not a rank failure
    assert "step 2999" not in text
    assert_clean(tmp_path)


@pytest.mark.timeout(180)
def test_a_second_ctrl_c_stops_the_ranks_without_waiting_out_the_grace(tmp_path):
    out = tmp_path / "out.txt"
    env = dict(local_env(tmp_path), EDDIS_INTERRUPT_GRACE="600")
    with open(out, "w") as sink:
        proc = subprocess.Popen(["eddis-train", "--local", "-n", "2", str(INTERRUPTIBLE), str(tmp_path),
                                 "--ignore-sigint"], env=env, cwd=str(REPO), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            while not all(re.search(rf"^\[{r}@\S+\] step 3$", out.read_text(), re.M) for r in (0, 1)):
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)
            while len(re.findall(r"stopping the trainer \(SIGINT first\)", out.read_text())) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=90)   # far less than the 600 s grace
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert code == 130 and "eddis-train: interrupted by SIGINT" in text, text
    assert "never interrupted" not in text and "ROOT CAUSE" not in text, text
    assert_clean(tmp_path)


HANDLER_SCRIPT = """
import time
try:
    print('ready', flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print('caught', flush=True)
    time.sleep(0.5)   # the same interrupt, delivered again, arrives in here
    print('handler done', flush=True)
"""


@pytest.mark.timeout(60)
def test_the_trainer_takes_a_doubly_delivered_interrupt_once(tmp_path):
    # Slurm signals every process of a step and the supervisor passes SIGINT on too: the
    # trainer's runner must not let the second copy break into the script's handler
    script = tmp_path / "handler.py"
    script.write_text(HANDLER_SCRIPT)
    # default SIGINT whatever the caller's: a shell's background job inherits it ignored
    # and SIGINT blocked, as a parent's blocked mask would leave it (CI once did): the runner
    # unblocks it
    def default_but_blocked():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    proc = subprocess.Popen([PYTHON, "-m", "eddis.launch.child", str(script)], env=python_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_but_blocked)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "caught"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out.strip() == "handler done", (out, err)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("when,error", [
    ("trace", r"    ValueError: Cannot reshape a tensor with 16 elements to shape \[3,5\]"),
    ("run", r"indices\[0\] = 7 is not in \[0, 4\)\n\s+\[\[\{\{node GatherV2\}\}\]\] \[Op:__inference_running_step_\d+\]")])
def test_a_tensorflow_error_in_a_tf_function_is_reported_with_the_users_line_and_the_error(tmp_path, when, error):
    """TensorFlow's errors name the real error and the user's line after their first line
    ("in user code:", "Graph execution error:"): the report keeps them."""
    script = REPO / "tests" / "launch_scripts" / "tf_function_error.py"
    proc = eddis_train(tmp_path, "--local", "-n", "2", script, "--when", when, timeout=220)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = proc.stderr[proc.stderr.index("ROOT CAUSE"):]
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ exited with code 1", report), report
    failing = "y = tf.reshape(x, [3, 5])" if when == "trace" else "in running_step"
    user_line = next(n for n, text in enumerate(script.read_text().splitlines(), 1)
                     if ("tf.reshape" if when == "trace" else "tf.gather") in text)
    assert re.search(rf'File "{re.escape(str(script))}", line {user_line}, in \w+_step', report), report
    assert failing in report and re.search(error, report), report
    assert "stopped by the launcher: rank 0" in report
    assert_clean(tmp_path)
