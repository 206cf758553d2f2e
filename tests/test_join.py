"""eddis.join() with real ranks (eddis-train --local): uneven numbers of batches per rank.

tests/launch_scripts/join_trainer.py trains a linear model with momentum SGD, rank r
taking 3 + r steps in epoch 0 and 2 + (size - 1 - r) in epoch 1 on batches of 4 + r
samples, weighted by sample count, and calls join() after each epoch. The parameters
every rank ends with must be those of the sample-weighted mean over the ranks that
still had data at each step (recomputed here in float64), and join() must name the
rank that took the most steps.
"""
import json
import re
import sys

import numpy as np
import pytest

from conftest import REPO
from test_launch_local import eddis_train

import eddis.smb.server  # noqa: F401  (required: missing is a failure, not a skip)

pytestmark = pytest.mark.mpi  # starts real Open MPI ranks

SCRIPT = REPO / "tests" / "launch_scripts" / "join_trainer.py"
sys.path.insert(0, str(SCRIPT.parent))
import join_trainer as trainer  # noqa: E402  (the batches and schedule the ranks use)


def reference(size):
    """Parameters after both epochs: at each step, the sample-weighted mean gradient of
    the ranks that still have data; momentum SGD as torch and Keras do it."""
    w, b = (a.astype(np.float64) for a in trainer.initial())
    params = np.concatenate([w.reshape(-1), b])
    velocity = np.zeros_like(params)
    for epoch in range(2):
        longest = max(trainer.steps_of(epoch, r, size) for r in range(size))
        for step in range(longest):
            total, weight = np.zeros_like(params), 0.0
            for r in range(size):
                if step >= trainer.steps_of(epoch, r, size):
                    continue  # joined: contributes nothing
                x, y = (a.astype(np.float64) for a in trainer.batch(epoch, r, step))
                residual = x @ params[:-1].reshape(-1, 1) + params[-1] - y
                grad = np.concatenate([(2.0 / len(x)) * (x.T @ residual).reshape(-1),
                                       [(2.0 / len(x)) * residual.sum()]])
                total += len(x) * grad
                weight += len(x)
            velocity = trainer.MOMENTUM * velocity + total / weight
            params = params - trainer.LR * velocity
    return params


def results(proc, size, run=0):
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    found = [r for r in map(json.loads, re.findall(r"JOIN-RESULT (\{.*\})", proc.stdout)) if r["run"] == run]
    assert sorted(r["rank"] for r in found) == list(range(size)), output[-8000:]
    return found


def expected_lasts(size):
    # epoch 0: the highest rank takes the most steps; epoch 1: rank 0 does
    return [size - 1, 0]


# (framework, ranks) -> the runs one launch makes, one after the other: "MODE [tape] [NAME=VALUE ...]"
LAUNCHES = {
    ("torch", 2): ["allreduce",
                   "sync EDDIS_SYNC_REDUCE=hierarchical"],
    ("torch", 3): ["allreduce EDDIS_CHECK_PARAMETERS=1",          # the drift check at every step
                   "sync",                                        # the ranks' sum on one node
                   "sync EDDIS_SYNC_REDUCE=server EDDIS_CHECK_PARAMETERS=1"],
    ("tensorflow", 2): ["sync EDDIS_CHECK_PARAMETERS=1"],
    # tape: a joined rank's variables stay behind; the script broadcasts the last rank's after join()
    ("tensorflow", 3): ["allreduce",
                        "sync tape EDDIS_CHECK_PARAMETERS=1"],
}
_launched = {}


def launched(tmp_path_factory, framework, size):
    if (framework, size) not in _launched:
        runs = [arg for run in LAUNCHES[framework, size] for arg in ("--run", run)]
        _launched[framework, size] = eddis_train(tmp_path_factory.mktemp(f"join-{framework}-{size}"), "--local",
                                                 "-n", str(size), SCRIPT, "--framework", framework, *runs,
                                                 timeout=280)
    return _launched[framework, size]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework,size,run", [(framework, size, run) for (framework, size), runs
                                                in LAUNCHES.items() for run in runs])
def test_join_uneven_batches_matches_the_weighted_mean_of_the_ranks_with_data(tmp_path_factory, framework, size,
                                                                            run):
    proc = launched(tmp_path_factory, framework, size)
    want = reference(size)
    for found in results(proc, size, LAUNCHES[framework, size].index(run)):
        assert found["lasts"] == expected_lasts(size), found
        got = np.array(found["params"], dtype=np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                   err_msg=f"rank {found['rank']} ({framework}, {run})")


@pytest.mark.timeout(300)
def test_a_joined_rank_takes_the_periodic_checkpoints_of_its_idle_steps(tmp_path):
    # 3 ranks, 9 steps each, idle ones included; every 4 steps a checkpoint: rank 0 (the
    # ranks' leader, which asks for the periodic ones) has joined at step 4, rank 2 at step 8
    folder = tmp_path / "ckpt"
    proc = eddis_train(tmp_path, "--local", "-n", "3", SCRIPT, "--framework", "torch",
                       "--run", "sync EDDIS_CHECKPOINT_INTERVAL=4", timeout=280,
                       env={"EDDIS_CHECKPOINT_DIR": str(folder)})
    want = reference(3)
    for found in results(proc, 3):
        np.testing.assert_allclose(np.array(found["params"], dtype=np.float64), want, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt-00000004", "ckpt-00000008"]


@pytest.mark.timeout(300)
def test_join_in_easgd_is_a_counted_barrier_naming_the_last_rank(tmp_path):
    proc = eddis_train(tmp_path, "--local", "-n", "3", SCRIPT, "--framework", "torch", "--mode", "easgd",
                       timeout=280)
    found = results(proc, 3)
    lasts = {tuple(r["lasts"]) for r in found}
    assert len(lasts) == 1, found          # the same answer on every rank
    (epoch0, epoch1), = lasts
    assert 0 <= epoch0 < 3 and 0 <= epoch1 < 3
    final = {tuple(np.round(r["params"], 6)) for r in found}
    assert len(final) == 1, found          # final_model(): the centre on every rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "allreduce", "easgd"])
def test_a_joined_rank_serves_an_allreduce_and_refuses_a_broadcast_naming_itself(tmp_path, mode):
    proc = eddis_train(tmp_path, "--local", "-n", "2", SCRIPT, "--framework", "torch", "--mode", mode,
                       "--misuse", timeout=280)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-6000:]
    served = re.search(r"JOIN-SERVED (.*)", proc.stdout)
    assert served and float(served.group(1)) == 0.5, output[-6000:]   # (1 + 0) / 2 ranks, as Horovod
    line = re.search(r"JOIN-MISUSE (.*)", proc.stdout)
    assert line, output[-6000:]
    assert "eddis.broadcast(loss): rank(s) [1] called eddis.join()" in line.group(1), line.group(1)
