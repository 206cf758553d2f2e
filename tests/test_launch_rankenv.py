"""Pure parts of the launcher: host lists, the srun/mpirun -> EDDIS_* mapping, GPU binding and type,
traceback capture and the root-cause report. The Slurm environments below are what srun 22.05 gave
the tasks of a real hetjob on the dev cluster (n1: a100, n2: v100), trimmed to the variables read."""
import io
import threading

import pytest

from eddis.errors import ConfigError
from eddis.launch.hostlist import expand_hostlist, expand_tasks_per_node
from eddis.launch.output import LinePump, TracebackCatcher
from eddis.launch.rankenv import (bind_gpu, detect, from_openmpi, from_slurm, gpu_type_from_model,
                                  gpu_types_from_gres, resolve_gpu_type)
from eddis.launch.report import format_report

HET_STEP = {
    "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "1", "SLURM_HET_SIZE": "2", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n1", "SLURM_JOB_NODELIST_HET_GROUP_1": "n2",
    "SLURM_NTASKS_HET_GROUP_0": "2", "SLURM_NTASKS_HET_GROUP_1": "2",
    "SLURM_JOB_PARTITION": "v100",  # srun 22.05 gives every task the LAST component's partition
    "SLURM_JOB_PARTITION_HET_GROUP_0": "a100", "SLURM_JOB_PARTITION_HET_GROUP_1": "v100",
    "SLURM_STEP_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1",
}
TASKS = {  # procid: (node, localid, nodeid, gtids)
    0: ("n1", 0, 0, "0,1"), 1: ("n1", 1, 0, "0,1"), 2: ("n2", 0, 1, "2,3"), 3: ("n2", 1, 1, "2,3"),
}
NODE_GRES = {"n1": "gpu:a100:2", "n2": "gpu:v100:2(S:0)"}


def het_task(procid, **extra):
    node, local, nodeid, gtids = TASKS[procid]
    env = dict(HET_STEP, SLURM_PROCID=str(procid), SLURM_LOCALID=str(local), SLURM_NODEID=str(nodeid),
               SLURM_GTIDS=gtids, SLURMD_NODENAME=node)
    env.update(extra)
    return env


def test_hostlist_expansion():
    assert expand_hostlist("n[1-3,7],gpu01") == ["n1", "n2", "n3", "n7", "gpu01"]
    assert expand_hostlist("node[08-10]") == ["node08", "node09", "node10"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_hostlist("") == [] and expand_hostlist("(null)") == []
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="unmatched"):
        expand_hostlist("n[1-2")
    with pytest.raises(ConfigError, match="bad range"):
        expand_hostlist("n[3-1]")


@pytest.mark.parametrize("procid,group,local,gpu,gpu_type", [
    (0, 0, 0, "0", "a100"), (1, 0, 1, "1", "a100"), (2, 1, 0, "0", "v100"), (3, 1, 1, "1", "v100")])
def test_hetjob_task_mapping(procid, group, local, gpu, gpu_type):
    info = from_slurm(het_task(procid), gres_lookup=NODE_GRES.get)
    assert (info.rank, info.size, info.local_rank, info.local_size) == (procid, 4, local, 2)
    assert (info.group, info.num_groups, info.group_size) == (group, 2, 2)
    assert (info.gpu, info.gpu_type, info.hostname) == (gpu, gpu_type, TASKS[procid][0])
    env = info.environ("/run/dir")
    assert env["EDDIS_RANK"] == str(procid) and env["EDDIS_GROUP"] == str(group)
    assert env["CUDA_VISIBLE_DEVICES"] == gpu and env["EDDIS_LAUNCHED"] == "1"
    assert env["EDDIS_RUN_DIR"] == "/run/dir" and env["EDDIS_GPU_TYPE"] == gpu_type


def test_gpu_type_falls_back_to_the_component_partition_not_the_last_one():
    # without a GRES answer the partition of the task's own component decides (not SLURM_JOB_PARTITION)
    info = from_slurm(het_task(0), gres_lookup=lambda node: None)
    assert info.gpu_type == "a100"


def test_components_sharing_a_node_are_told_apart_by_task_counts():
    env = het_task(3, SLURM_JOB_NODELIST_HET_GROUP_0="n1", SLURM_JOB_NODELIST_HET_GROUP_1="n1",
                   SLURMD_NODENAME="n1")
    assert from_slurm(env, gres_lookup=None).group == 1


def test_plain_job_and_no_gpu():
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURMD_NODENAME": "c2"}
    info = detect(env, gres_lookup=None)
    # a plain job's groups are its nodes
    assert (info.rank, info.size, info.local_rank, info.local_size, info.group, info.num_groups,
            info.group_size) == (3, 4, 1, 2, 1, 2, 2)
    assert info.gpu is None and info.gpu_type == "cpu" and "CUDA_VISIBLE_DEVICES" not in info.environ()


def test_openmpi_environment_and_explicit_gpu_type():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "CUDA_VISIBLE_DEVICES": "2,3", "EDDIS_GPU_TYPE": "h100"}
    info = from_openmpi(env)
    assert (info.rank, info.size, info.local_rank, info.gpu, info.gpu_type) == (1, 2, 1, "3", "h100")
    assert detect(env).launcher == "mpirun"


def test_missing_rank_variable_is_a_clear_error():
    with pytest.raises(ConfigError, match="SLURM_PROCID is not set"):
        from_slurm({"SLURM_STEP_ID": "0"})


def test_gpu_helpers():
    assert bind_gpu(["4", "5"], 3) == "5" and bind_gpu([], 0) is None
    assert gpu_types_from_gres("gpu:a100:2(S:0-1),gpu:v100:1,gpu:3,mps:100") == ["a100", "v100"]
    assert gpu_type_from_model("NVIDIA A100-SXM4-40GB") == "a100"
    assert gpu_type_from_model("Tesla V100-PCIE-16GB") == "v100"
    assert gpu_type_from_model("partition-big") is None
    env = {"SLURM_JOB_ID": "1"}
    assert resolve_gpu_type(env, "n9", 0, ["0"], gres_lookup=lambda n: "gpu:h100:8") == "h100"
    assert resolve_gpu_type(env, "n9", 0, [], gres_lookup=lambda n: "gpu:h100:8") == "cpu"


def test_traceback_catcher_keeps_the_first_traceback_only():
    catcher = TracebackCatcher()
    text = ("noise\nTraceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n    f()\n"
            "ValueError: first\nTraceback (most recent call last):\n  File \"t.py\", line 9\nKeyError: 'second'\n")
    for line in text.splitlines(keepends=True):
        catcher.feed(line.encode())
    assert catcher.result().splitlines() == ["Traceback (most recent call last):",
                                             '  File "t.py", line 1, in <module>', "    f()", "ValueError: first"]


def test_traceback_catcher_keeps_the_crashed_threads_stack_from_faulthandler():
    text = ("Fatal Python error: Segmentation fault\n\nThread 0x01 (most recent call first):\n"
            '  File "liveness.py", line 103 in beat\n\nCurrent thread 0x02 (most recent call first):\n'
            '  File "t.py", line 5 in step\n  File "t.py", line 9 in <module>\n\n'
            "Extension modules: torch._C (total: 1)\n[n1:1:0:1] Caught signal 11\n"
            "Traceback (most recent call last):\nValueError: later\n")
    catcher = TracebackCatcher()
    for line in text.splitlines(keepends=True):
        catcher.feed(line.encode())
    assert catcher.result().splitlines() == ["Fatal Python error: Segmentation fault",
                                             "Current thread 0x02 (most recent call first):",
                                             '  File "t.py", line 5 in step', '  File "t.py", line 9 in <module>']
    # a crash on a native thread: no "Current thread", every stack is kept; cut off, what came
    cut = TracebackCatcher()
    for line in text.splitlines(keepends=True)[:4]:
        cut.feed(line.encode())
    assert cut.result().splitlines() == ["Fatal Python error: Segmentation fault", "",
                                         "Thread 0x01 (most recent call first):", '  File "liveness.py", line 103 in beat']


def test_line_pump_prefixes_every_line_and_keeps_an_unterminated_last_line():
    source, sink = io.BytesIO(b"one\ntwo\nlast without newline"), io.BytesIO()
    pump = LinePump(source, sink, "[3@n2] ", threading.Lock())
    pump.start()
    pump.join(5)
    assert sink.getvalue() == b"[3@n2] one\n[3@n2] two\n[3@n2] last without newline\n"


def test_report_names_rank_host_code_and_traceback():
    first = {"rank": 2, "host": "n2", "code": None, "signal": 9, "time": 100.0, "command": ["train.py"],
             "traceback": None, "tail": ["step 3"]}
    later = {"rank": 0, "host": "n1", "code": 1, "signal": None, "time": 101.0, "traceback": "Traceback ...\nX: y"}
    exits = [{"rank": 1, "why": "stopped"}, {"rank": 3, "why": "stopped"}]
    text = format_report(first, [first, later], exits, run_dir="/r")
    assert "ROOT CAUSE: rank 2 on host n2 was killed by signal 9 (SIGKILL)" in text
    assert "rank 0@n1 (exited with code 1)" in text and "stopped by the launcher: rank 1, 3" in text
    assert "no rank recorded a failure" in format_report(None, [], [], job_code=143)


def test_gres_answer_is_shared_by_the_ranks_of_a_node(tmp_path):
    from eddis.launch.rankenv import CachedGres

    calls = []

    def lookup(node):
        calls.append(node)
        return NODE_GRES.get(node)

    for rank in (0, 1, 2, 3):  # two ranks per node, each its own CachedGres as in separate processes
        info = from_slurm(het_task(rank), gres_lookup=CachedGres(str(tmp_path / "nodes"), lookup))
        assert info.gpu_type == ("a100" if rank < 2 else "v100")
    assert calls == ["n1", "n2"]
