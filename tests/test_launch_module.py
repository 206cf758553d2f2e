"""``eddis-train ... -m MODULE [ARGS]`` runs a module on every rank as ``python -m`` does: in
``--local`` (mpirun starts each rank's ``eddis-train -m ...``, the plain srun form), and in a
Slurm job (``eddis-train --job -- -m ...``). The module's arguments reach it untouched, even
those that look like eddis-train's own options, and a ``--`` among them.
"""
import json
import os
import re
import sys

import pytest

from conftest import run_process_group
from launch_helpers import make_bin, wait_job_end
from test_launch_local import assert_clean, local_env

from eddis.launch.train import parse_args

ECHO = """\
import json, os, sys
print("ECHO " + json.dumps({"argv": sys.argv[1:], "name": __name__, "file": os.path.basename(sys.argv[0]),
                            "rank": os.environ["EDDIS_RANK"], "size": os.environ["EDDIS_SIZE"],
                            "cwd_first": sys.path[0] in ("", os.getcwd())}))
"""
# what eddis-train takes for its own, a "--", a "-m": all the module's
MODULE_ARGS = ["-n", "5", "--local", "--job", "--", "-m", "x", "--memory=1G"]


def echo_package(folder):
    package = folder / "echo_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "argv.py").write_text(ECHO)
    return folder


def echoes(text):
    return sorted((json.loads(m) for m in re.findall(r"^\[\d@\S+\] ECHO (.*)$", text, re.M)),
                  key=lambda e: e["rank"])


# what each of 2 ranks must print: MODULE_ARGS, run as __main__ from its file, the working
# directory first on sys.path
RAN_AS_PYTHON_M = [{"argv": MODULE_ARGS, "name": "__main__", "file": "argv.py", "rank": str(rank), "size": "2",
                    "cwd_first": True} for rank in (0, 1)]


def test_the_module_and_its_arguments_are_the_command_as_given():
    args = parse_args(["--local", "-n", "2", "-m", "pkg.train", *MODULE_ARGS])
    assert (args.local, args.np, args.script) == (True, 2, ["-m", "pkg.train", *MODULE_ARGS])
    assert parse_args(["--job", "--", "-m", "pkg.train", "-q"]).script == ["--", "-m", "pkg.train", "-q"]
    assert parse_args(["train.py", "-m", "x"]).script == ["train.py", "-m", "x"]   # the script's own -m


@pytest.mark.parametrize("argv", [["--local", "-m"], ["--local", "-m", "-n", "2"]])
def test_a_missing_module_name_is_explained(argv, capsys):
    from eddis.launch.train import main

    assert main(argv) == 2
    assert "-m needs a module name right after it, as python -m does" in capsys.readouterr().err


def test_a_module_is_looked_up_from_the_working_directory_first(tmp_path, monkeypatch):
    from eddis.slurm.command import missing_script

    monkeypatch.chdir(echo_package(tmp_path / "work"))
    assert missing_script(["-m", "echo_pkg.argv", "--x"]) is None
    assert missing_script(["-m", "json.tool"]) is None
    assert "echo_pkg" not in sys.modules   # looked up, not imported
    why = missing_script(["-m", "no_such_pkg.train"])
    assert why.startswith("-m no_such_pkg.train: no module named 'no_such_pkg'") and str(tmp_path) in why, why
    assert "is not a module name" in missing_script(["-m", "1st.train"])
    assert "is not a module name" in missing_script(["-m", "echo_pkg.2nd"])


def test_a_submodule_is_looked_up_without_importing_its_package(tmp_path, monkeypatch):
    """``-m pkg.mod`` once passed the check whenever ``pkg`` was there; the rank then failed."""
    from eddis.slurm.command import missing_script

    work = echo_package(tmp_path / "work")
    (work / "echo_pkg" / "__init__.py").write_text("raise SystemExit('imported on the launching host')\n")
    (work / "echo_pkg" / "inner").mkdir()
    (work / "echo_pkg" / "inner" / "__init__.py").write_text("")
    (work / "echo_pkg" / "inner" / "run.py").write_text(ECHO)
    (work / "plain.py").write_text("")
    # a package split over two folders, as pkgutil.extend_path (or a namespace package) has it
    for folder, module in (("one", "first"), ("two", "second")):
        (tmp_path / folder / "split_pkg").mkdir(parents=True)
        (tmp_path / folder / "split_pkg" / "__init__.py").write_text(
            "__path__ = __import__('pkgutil').extend_path(__path__, __name__)\n")
        (tmp_path / folder / "split_pkg" / f"{module}.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path / folder))
    monkeypatch.chdir(work)
    assert missing_script(["-m", "echo_pkg.argv"]) is None
    assert missing_script(["-m", "echo_pkg.inner.run"]) is None
    assert missing_script(["-m", "split_pkg.first"]) is None
    assert missing_script(["-m", "split_pkg.second"]) is None
    why = missing_script(["-m", "echo_pkg.trian"])
    assert why.startswith("-m echo_pkg.trian: package echo_pkg has no module 'trian'"), why
    assert str(work / "echo_pkg") in why
    assert "package echo_pkg.inner has no module 'nope'" in missing_script(["-m", "echo_pkg.inner.nope"])
    assert "plain is a module" in missing_script(["-m", "plain.train"])
    assert "package split_pkg has no module 'third'" in missing_script(["-m", "split_pkg.third"])
    assert not {"echo_pkg", "split_pkg", "plain"} & set(sys.modules)   # looked up, none imported


def test_a_module_that_is_not_there_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    from eddis.launch.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EDDIS_RUN_DIR", str(tmp_path / "run"))
    assert main(["--local", "-n", "2", "-m", "no_such_pkg.train", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "no module named 'no_such_pkg'" in err and "nothing was started" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_local_runs_a_module_on_every_rank_as_python_m_does(tmp_path):
    work = echo_package(tmp_path / "work")
    proc = run_process_group(["eddis-train", "--local", "-n", "2", "-m", "echo_pkg.argv", *MODULE_ARGS],
                             local_env(tmp_path), 120, cwd=str(work))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert echoes(proc.stdout) == RAN_AS_PYTHON_M, proc.stdout
    assert_clean(tmp_path)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_local_runs_pytest_as_a_module(tmp_path):
    work = tmp_path / "work"
    work.mkdir()

    def pytest_on_2_ranks(test, name):
        (work / "test_on_a_rank.py").write_text(test)
        return run_process_group(["eddis-train", "--local", "-n", "2", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "test_on_a_rank.py"], local_env(tmp_path / name), 120, cwd=str(work))

    proc = pytest_on_2_ranks("import os\n\ndef test_the_rank_is_one_of_two():\n"
                             "    assert os.environ['EDDIS_SIZE'] == '2' and os.environ['EDDIS_RANK'] in ('0', '1')\n",
                             "passes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}@\S+\] 1 passed", proc.stdout, re.M), proc.stdout
    # a failing test fails the rank, and so the job, as pytest's status
    failed = pytest_on_2_ranks("def test_fails():\n    assert False\n", "fails")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert re.search(r"ROOT CAUSE: rank \d on host \S+ exited with code 1", failed.stderr), failed.stderr


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_job_runs_a_module_on_every_rank(slurm_cluster, tmp_path):
    from eddis.slurm.script import JobComponent, render_job_script

    work = echo_package(tmp_path / "work")
    log = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(render_job_script(components=[JobComponent("all", nodes=2, tasks_per_node=1)],
                                        command=["-m", "echo_pkg.argv", *MODULE_ARGS], output=str(log),
                                        job_name="eddis-module-test", time="00:05:00", checkpoint_signal=0))
    bin_dir = make_bin(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EDDIS_RUN_DIR": str(tmp_path / "run"),
           "SMB_MEMORY": "64M", "OMP_NUM_THREADS": "1"}
    job_id = slurm_cluster.run(["sbatch", "--parsable", f"--chdir={work}", str(script)], env=env,
                               timeout=60).stdout.strip()
    state = wait_job_end(slurm_cluster, job_id, 240, log)
    text = log.read_text(errors="replace")
    assert state == ("COMPLETED", "0:0"), text[-4000:]
    assert echoes(text) == RAN_AS_PYTHON_M, text[-4000:]
