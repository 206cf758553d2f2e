"""The job script renderer (pure), the partition planner (pure, over sinfo text) and the shipped
scripts/eddis_job.sh, which must stay the renderer's output."""
import subprocess
from pathlib import Path

import pytest

from eddis.errors import ConfigError
from eddis.slurm.discovery import parse_gres, parse_sinfo
from eddis.slurm.script import JobComponent, example_job_script, render_job_script
from eddis.slurm.submit import parse_counts, plan_components

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"

SINFO = """all|gpu:a100:2|1|4|up
all|gpu:v100:2|1|4|up
a100|gpu:a100:2|1|4|up
v100|gpu:v100:2|1|4|up
cpu|(null)|8|64|up
big|gpu:h100:8(S:0-1)|4|128|down
"""


def test_shipped_job_script_is_the_renderers_output():
    assert (REPO / "scripts" / "eddis_job.sh").read_text() == example_job_script(), \
        "scripts/eddis_job.sh is stale: regenerate it from eddis.slurm.script.example_job_script()"


def test_rendered_scripts_are_valid_bash():
    for text in (example_job_script(),
                 render_job_script(components=[JobComponent("cpu", nodes=2, tasks_per_node=4)],
                                   command=["train.py", "--name", "it's"], mode="easgd",
                                   settings={"SMB_MEMORY": "2G"})):
        proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr


def test_render_matches_golden_file():
    text = render_job_script(
        components=[JobComponent("a100", nodes=2, tasks_per_node=4, gpu_type="a100", gpus_per_node=4),
                    JobComponent("v100", nodes=1, tasks_per_node=8, gpu_type="v100", gpus_per_node=8)],
        command=["train.py", "--epochs", "3"], job_name="resnet", time="02:00:00", mode="hybrid",
        account="proj42", settings={"SMB_MEMORY": "8G"})
    assert text == (GOLDEN / "render_a100x2_v100x1.sh").read_text()


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        render_job_script(components=[JobComponent("a100", 1, 1)], partitions="a100")
    message = str(err.value)
    assert "unknown option partitions" in message
    for name in ("components", "command", "time", "mode", "job_name", "account", "settings", "server_wait"):
        assert name in message
    with pytest.raises(ConfigError, match="keyword options only"):
        render_job_script([JobComponent("a100", 1, 1)])
    with pytest.raises(ConfigError, match="missing option components"):
        render_job_script(command=["x.py"])
    with pytest.raises(ConfigError, match="only EDDIS_"):
        render_job_script(components=[JobComponent("a100", 1, 1)], settings={"PATH": "/x"})


def test_one_component_is_not_a_hetjob():
    text = render_job_script(components=[JobComponent("a100", nodes=1, tasks_per_node=2, gpu_type="a100",
                                                      gpus_per_node=2)])
    assert "#SBATCH hetjob" not in text and "#SBATCH --gres=gpu:a100:2" in text


def test_sinfo_parsing():
    parts = {p.name: p for p in parse_sinfo(SINFO)}
    assert parts["all"].gpus_per_node == {"a100": 2, "v100": 2} and parts["all"].nodes == 2
    assert parts["cpu"].gpus_per_node == {} and parts["cpu"].nodes == 8
    assert parts["big"].gpus_per_node == {"h100": 8} and not parts["big"].available
    assert parse_gres("gpu:4,gpu:t4:1") == {"gpu": 4, "t4": 1}


def test_plan_prefers_the_partition_of_one_gpu_type():
    parts = parse_sinfo(SINFO)
    a, v = plan_components(parse_counts("a100:2,v100:1", "--gpus"), parts)
    assert (a.partition, a.nodes, a.tasks_per_node, a.gpus_per_node) == ("a100", 1, 2, 2)
    assert (v.partition, v.nodes, v.tasks_per_node) == ("v100", 1, 1)
    (h,) = plan_components([("h100", 16)], parts)
    assert (h.partition, h.nodes, h.gpus_per_node) == ("big", 2, 8)
    (h,) = plan_components([("h100", 16)], parts, default_nodes=4)
    assert (h.nodes, h.gpus_per_node) == (4, 4)


def test_plan_errors_name_the_problem_and_the_partitions():
    parts = parse_sinfo(SINFO)
    with pytest.raises(ConfigError, match=r"no partition named 'p100'.*a100 \(a100 x2/node; 1 node\)"):
        plan_components([("p100", 2)], parts)
    with pytest.raises(ConfigError, match=r"more than partition a100 has: 2 a100 GPUs \(1 node x 2 per node\)"):
        plan_components([("a100", 4)], parts)
    with pytest.raises(ConfigError, match="not a whole number per node"):
        plan_components([("h100", 9)], parts, default_nodes=2)
    with pytest.raises(ConfigError, match="NAME:COUNT"):
        parse_counts("a100", "--gpus")
    with pytest.raises(ConfigError, match="ask for a type"):
        plan_components([("all", 2)], parts)


def _stub_eddis_train(bin_dir):
    """An eddis-train on PATH that prints the arguments the job script gave it, one a line."""
    bin_dir.mkdir()
    stub = bin_dir / "eddis-train"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n')
    stub.chmod(0o755)
    return bin_dir


@pytest.mark.timeout(60)
def test_the_script_is_one_command_with_its_default(tmp_path):
    # everything a job does is eddis-train --job: what the script runs is all that is left in bash
    bin_dir = _stub_eddis_train(tmp_path / "bin")
    script = tmp_path / "job.sh"
    script.write_text(render_job_script(components=[JobComponent("cpu", nodes=1, tasks_per_node=1)],
                                        command=["train.py", "--name", "it's"]))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}  # no SLURM_* and no HOME: set -u must not trip
    default = subprocess.run(["bash", script], capture_output=True, text=True, timeout=30, env=env)
    assert default.returncode == 0, default.stderr
    assert default.stdout.split("\n")[:-1] == ["[--job]", "[--]", "[train.py]", "[--name]", "[it's]"]
    given = subprocess.run(["bash", script, "other.py", "a b", ""], capture_output=True, text=True,
                           timeout=30, env=env)
    assert given.stdout.split("\n")[:-1] == ["[--job]", "[--]", "[other.py]", "[a b]", "[]"], given.stderr


def test_server_wait_becomes_the_setting():
    text = render_job_script(components=[JobComponent("cpu", nodes=1, tasks_per_node=1)], server_wait=300)
    assert "export EDDIS_SERVER_WAIT=300\n" in text
    with pytest.raises(ConfigError, match="server_wait must be a number of seconds"):
        render_job_script(components=[JobComponent("cpu", nodes=1, tasks_per_node=1)], server_wait="soon")


def test_the_checkpoint_signal_asks_for_a_requeueable_job_that_appends_its_output():
    one = [JobComponent("a100", 1, 1)]
    lines = render_job_script(components=one, time="00:30:00", checkpoint_signal=120).splitlines()
    assert ["#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"] == \
        [line for line in lines if line.startswith(("#SBATCH --signal", "#SBATCH --requeue", "#SBATCH --open-mode"))]
    for none in (0, None):
        text = render_job_script(components=one, time="00:30:00", checkpoint_signal=none)
        assert "--signal" not in text and "--requeue" not in text


@pytest.mark.parametrize("time, signal, message", [
    ("5", 300, "must come after the job starts, but the time limit is 5"),
    ("00:30:00", -1, "checkpoint_signal must be whole seconds >= 0"),
    ("00:30:00", 1.5, "checkpoint_signal must be whole seconds >= 0"),
    ("half an hour", 60, "time limit 'half an hour': write minutes"),
])
def test_a_checkpoint_signal_the_job_cannot_use_is_refused(time, signal, message):
    with pytest.raises(ConfigError, match=message):
        render_job_script(components=[JobComponent("a100", 1, 1)], time=time, checkpoint_signal=signal)


@pytest.mark.parametrize("text, seconds", [("1", 60), ("5:30", 330), ("01:00:00", 3600), ("2-3", 183600),
                                           ("2-3:04", 183840), ("2-03:04:05", 183845),
                                           ("UNLIMITED", float("inf"))])
def test_time_limits_are_read_as_sbatch_reads_them(text, seconds):
    from eddis.slurm.script import time_limit_seconds

    assert time_limit_seconds(text) == seconds


# A value of every option of the renderer, with room for a bad text; server_wait and
# checkpoint_signal are numbers, which cannot carry one.
NUMBER_OPTIONS = {"server_wait", "checkpoint_signal"}
GOOD_OPTIONS = dict(components=[JobComponent("a100", nodes=1, tasks_per_node=2, gpu_type="a100", gpus_per_node=2)],
                    command=("train.py", "--epochs", "3"), job_name="resnet", time="01:00:00",
                    output="eddis-%j.out", account="proj42", mode="sync", settings={"SMB_MEMORY": "2G"},
                    server_wait=60.0, comment="a comment", checkpoint_signal=300)
BAD_OPTIONS = {
    "components": [lambda bad: [JobComponent("a100" + bad, nodes=1, tasks_per_node=2)],
                   lambda bad: [JobComponent("a100", nodes=1, tasks_per_node=2, gpu_type="a100" + bad,
                                             gpus_per_node=2)]],
    "command": [lambda bad: ("train.py" + bad,), lambda bad: ("train.py", "--name", "x" + bad)],
    "job_name": [lambda bad: "x" + bad],
    "time": [lambda bad: "01:00:00" + bad],
    "output": [lambda bad: "out" + bad],
    "account": [lambda bad: "proj" + bad],
    "mode": [lambda bad: "sync" + bad],
    "settings": [lambda bad: {"SMB_MEMORY": "2G" + bad}, lambda bad: {"SMB_MEMORY" + bad: "2G"}],
    "comment": [lambda bad: "a comment" + bad],
}
CONTROL_CHARACTERS = ["\necho INJECTED", "\r", "\x00", "\t", "\x1b[2J", "\x7f", "\x85"]


def test_every_text_option_is_in_the_control_character_table():
    # a new option of the renderer must be added to BAD_OPTIONS (or NUMBER_OPTIONS) to be tested
    assert set(BAD_OPTIONS) | NUMBER_OPTIONS == set(render_job_script.valid_options)
    render_job_script(**GOOD_OPTIONS)


# a comment may span lines, each written as a comment line (the next test)
@pytest.mark.parametrize("option, bad", [(o, b) for o in sorted(BAD_OPTIONS) for b in CONTROL_CHARACTERS
                                         if not (o == "comment" and b.startswith("\n"))], ids=repr)
def test_a_control_character_in_any_option_is_refused(option, bad):
    for make in BAD_OPTIONS[option]:
        with pytest.raises(ConfigError) as err:
            render_job_script(**dict(GOOD_OPTIONS, **{option: make(bad)}))
        message = str(err.value)
        assert message.startswith(option) and f"holds the control character {bad[0]!r}" in message, message
        assert "Remove it" in message


def test_a_comment_spans_comment_lines_only():
    text = render_job_script(**dict(GOOD_OPTIONS, comment="first\necho NOT RUN"))
    assert "# first\n# echo NOT RUN\n" in text
    assert [line for line in text.splitlines() if "NOT RUN" in line] == ["# echo NOT RUN"]


def test_the_refusal_names_the_eddis_submit_flag():
    with pytest.raises(ConfigError, match=r"job_name \(eddis submit --job-name\) 'x\\necho INJECTED' holds"):
        render_job_script(**dict(GOOD_OPTIONS, job_name="x\necho INJECTED"))
    with pytest.raises(ConfigError, match="in a file instead"):
        render_job_script(**dict(GOOD_OPTIONS, command=("train.py", "line 1\nline 2")))


@pytest.mark.parametrize("exports, message", [
    ({"EDDIS_LIVENESS_TIMEOUT": "-5"}, "EDDIS_LIVENESS_TIMEOUT must be >= 0"),
    ({"EDDIS_MOED": "sync"}, "Did you mean EDDIS_MODE"),
    ({"SMB_MEMORY": "0"}, "SMB_MEMORY must be >= 1"),
])
def test_a_setting_the_job_would_refuse_is_refused_when_the_script_is_written(exports, message):
    with pytest.raises(ConfigError, match=message):
        render_job_script(**dict(GOOD_OPTIONS, settings=exports))
    with pytest.raises(ConfigError, match="EDDIS_SERVER_WAIT must be > 0"):
        render_job_script(**dict(GOOD_OPTIONS, server_wait=0))


def test_eddis_submit_flags_of_settings_are_checked_by_the_registry(capsys):
    from eddis import cli

    for flag, value, message in (("--server-wait", "0", "--server-wait 0 is out of range: EDDIS_SERVER_WAIT "
                                                          "must be > 0"),
                                 ("--spare-nodes", "-1", "--spare-nodes -1 is out of range: EDDIS_SPARE_NODES "
                                                         "must be >= 0"),
                                 ("--memory", "0", "--memory 0 is out of range: SMB_MEMORY must be >= 1")):
        with pytest.raises(SystemExit) as exc:  # argparse: before sinfo is asked
            cli.main(["submit", "--gpus", "a100:1", flag, value, "--dry-run", "train.py"])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
