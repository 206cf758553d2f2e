"""Elastic reset callbacks run where Horovod runs them: after a reset, never at the first start.

Horovod's ``hvd.elastic.run`` calls ``state.on_reset()`` (``state.reset()``, then the
registered callbacks in their order) only when it runs the function again after a worker
was lost, before the ``sync()``. In EDDIS that is a run going on from a persisted commit:
a sync run restarted by EDDIS_MAX_RESTARTS after a lost rank. The launched test runs the
logic of Horovod's TF2 elastic example (tests/horovod_style/tensorflow2_elastic_reset_style.py),
whose reset callback fails under Keras 3 where it runs at the first start (``opt.lr``).
"""
import re

import pytest

from conftest import PYTHON, REPO, run_process_group
from test_checkpoint_resume import env_for

from eddis.core.checkpoint.elastic_state import ObjectState

SCRIPT = REPO / "tests" / "horovod_style" / "tensorflow2_elastic_reset_style.py"
KILL_AFTER = 12   # the batch whose commit rank 1 dies after on the first attempt


def test_on_reset_resets_the_state_then_runs_the_callbacks_in_their_order():
    calls = []

    class Recorded(ObjectState):
        def reset(self):
            calls.append("reset")

    state = Recorded(batch=0)
    state.register_reset_callbacks([lambda: calls.append("first"), lambda: calls.append("second")])
    state.register_reset_callbacks([lambda: calls.append("third")])
    assert calls == []
    state.on_reset()
    assert calls == ["reset", "first", "second", "third"]


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_horovod_tf2_elastic_example_runs_its_reset_callbacks_only_after_a_restart(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    env = env_for(tmp_path, EDDIS_MODE="sync", EDDIS_MAX_RESTARTS=1, ELASTIC_TEST_KILL_AFTER=KILL_AFTER)
    proc = run_process_group(["eddis-train", "--local", "-n", "2", PYTHON, str(SCRIPT), str(checkpoints)],
                             env, 280)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert re.search(r"ROOT CAUSE: rank 1 on host \S+ was killed by signal 9 \(SIGKILL\)", text), text[-6000:]
    assert text.count("restarting the smb-server and the ranks (restart 1 of 1)") == 1, text[-6000:]
    starts = sorted(re.findall(r"rank (\d) attempt (\d) starts at batch (\d+) after resets (\[.*\])", text))
    # the first start runs no callback; the restart from the commit at batch 12 runs both, in
    # their order, once, before the function (the learning rate scaled to 2 ranks)
    after_reset = "['on_state_reset(lr=0.002)', 'after_lr_scaled']"
    assert starts == [("0", "0", "0", "[]"), ("0", "1", str(KILL_AFTER), after_reset),
                      ("1", "0", "0", "[]"), ("1", "1", str(KILL_AFTER), after_reset)], text[-6000:]
    # the example takes 100 // size() batches from the one it starts at, after the restart too
    last = KILL_AFTER + 100 // 2 - 1
    for rank in (0, 1):
        assert f"TF2 ELASTIC EXAMPLE OK rank {rank} attempt 1 batch {last} resets {after_reset}" in text, \
            text[-6000:]
    assert "attempt 0 batch" not in text, text[-6000:]
    assert list(checkpoints.glob("ckpt-1.index")), sorted(p.name for p in checkpoints.iterdir())
