"""The pure parts of checkpoints: folder names, manifest, finding the latest complete one,
keep-last-N, the atomic commit, the interval setting, the request flag and the Start a
resume returns. The collective parts run on real ranks in tests/test_checkpoint_resume.py."""
import json
import os
import signal

import pytest

from eddis import __version__, settings
from eddis.core.checkpoint import folders as layout
from eddis.core.checkpoint import state as checkpoint_state
from eddis.core.checkpoint.resume import Start
from eddis.errors import CheckpointError, CheckpointStop, ConfigError, REQUEUE_EXIT_STATUS


def manifest(step=5, **kw):
    args = dict(framework="torch", world_size=2, mode="sync", step=step, epoch=1, batch=2,
                global_step=10, settings_used={"mode": "sync"}, files=["b", "a"])
    args.update(kw)
    return layout.make_manifest(**args)


def complete(root, step, files=("a",)):
    folder = root / layout.folder_name(step)
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_text("x")
    layout.write_manifest(str(folder), manifest(step, files=list(files)))
    return folder


def test_manifest_round_trip_records_version_world_size_mode_and_layout(tmp_path):
    m = manifest(extra={"note": "hi"})
    (tmp_path / "a").write_text("x")
    (tmp_path / "b").write_text("x")
    layout.write_manifest(str(tmp_path), m)
    back = layout.read_manifest(str(tmp_path))
    assert back["eddis_version"] == __version__ and back["format"] == layout.FORMAT
    assert (back["world_size"], back["mode"], back["step"], back["epoch"], back["batch"]) == (2, "sync", 5, 1, 2)
    assert back["files"] == ["a", "b"] and back["extra"] == {"note": "hi"}


def test_manifest_refuses_what_json_cannot_hold(tmp_path):
    with pytest.raises(CheckpointError, match="JSON values"):
        layout.write_manifest(str(tmp_path), manifest(extra={"tensor": object()}))


def test_read_manifest_names_a_missing_file_and_a_foreign_format(tmp_path):
    layout.write_manifest(str(tmp_path), manifest(files=["gone.h5"]))
    with pytest.raises(CheckpointError, match="lacks gone.h5"):
        layout.read_manifest(str(tmp_path))
    (tmp_path / layout.MANIFEST).write_text(json.dumps({"format": 99}))
    with pytest.raises(CheckpointError, match="format 99"):
        layout.read_manifest(str(tmp_path))
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        layout.read_manifest(str(tmp_path / "nothing"))


def test_latest_ignores_uncommitted_and_manifestless_folders(tmp_path):
    complete(tmp_path, 2)
    complete(tmp_path, 10)
    (tmp_path / layout.temporary_name(12, "abc")).mkdir()            # a crash mid-write
    (tmp_path / layout.folder_name(11)).mkdir()                        # no manifest
    assert [s for s, _ in layout.complete_checkpoints(str(tmp_path))] == [2, 10]
    assert layout.latest(str(tmp_path)) == str(tmp_path / "ckpt-00000010")
    assert layout.resolve(str(tmp_path)) == str(tmp_path / "ckpt-00000010")
    assert layout.resolve(str(tmp_path / "ckpt-00000002")) == str(tmp_path / "ckpt-00000002")


def test_resolve_of_an_empty_or_missing_folder_is_a_fresh_start(tmp_path):
    assert layout.resolve(str(tmp_path)) is None
    assert layout.resolve(str(tmp_path / "not-yet")) is None


def test_resolve_refuses_an_uncommitted_checkpoint_and_a_file(tmp_path):
    tmp = tmp_path / layout.temporary_name(3, "x")
    tmp.mkdir()
    with pytest.raises(CheckpointError, match="never completed"):
        layout.resolve(str(tmp))
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        layout.resolve(str(tmp_path / "f"))


def test_prune_keeps_the_newest_n_and_removes_stale_temporaries(tmp_path):
    for step in (1, 2, 3, 4):
        complete(tmp_path, step)
    (tmp_path / layout.temporary_name(3, "old")).mkdir()
    (tmp_path / layout.temporary_name(9, "now")).mkdir()               # maybe being written
    layout.prune(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt-00000003", "ckpt-00000004",
                                                   layout.temporary_name(9, "now")])
    layout.prune(str(tmp_path), 0)
    assert len(layout.complete_checkpoints(str(tmp_path))) == 2


def test_commit_renames_and_replaces_a_checkpoint_of_the_same_step(tmp_path):
    complete(tmp_path, 4, files=("old",))
    tmp = tmp_path / layout.temporary_name(4, "n")
    tmp.mkdir()
    (tmp / "new").write_text("x")
    layout.write_manifest(str(tmp), manifest(4, files=["new"]))
    layout.commit(str(tmp), str(tmp_path / layout.folder_name(4)))
    assert os.listdir(tmp_path) == ["ckpt-00000004"]
    assert layout.read_manifest(str(tmp_path / "ckpt-00000004"))["files"] == ["new"]


def test_a_checkpoint_of_the_live_ranks_names_them_and_the_lost_ones(tmp_path):
    m = manifest(world_size=4, mode="easgd", ranks=[3, 0, 2])
    assert (m["ranks"], m["lost_ranks"]) == ([0, 2, 3], [1])
    assert (layout.ranks_held(m), layout.lost_ranks(m)) == ([0, 2, 3], [1])
    whole = manifest(world_size=2)
    assert (whole["ranks"], whole["lost_ranks"]) == ([0, 1], [])
    # a manifest written before checkpoints of the live ranks: every rank is in it
    del whole["ranks"], whole["lost_ranks"]
    assert (layout.ranks_held(whole), layout.lost_ranks(whole)) == ([0, 1], [])


def test_a_worker_checkpoint_never_sorts_below_an_older_one(tmp_path):
    assert layout.number_for(str(tmp_path), 7, after_newest=True) == 7      # nothing there yet
    complete(tmp_path, 40)
    # a resumed easgd run on another number of workers at its step 5, or the rank that commits
    # after rank 0 was lost, at fewer steps than rank 0 had
    assert layout.number_for(str(tmp_path), 5, after_newest=True) == 41
    assert layout.number_for(str(tmp_path), 40, after_newest=True) == 40   # replaces, as in sync
    assert layout.number_for(str(tmp_path), 55, after_newest=True) == 55
    assert layout.number_for(str(tmp_path), 5, after_newest=False) == 5    # sync: the step it is


def test_the_lost_ranks_claims_count_as_consumed_and_their_steps_as_unknown():
    from eddis.core.checkpoint.state import LOST_STEPS, steps_and_consumed

    # rank 1 was lost; rank 2 had claimed 3 iterations it has not run yet
    steps, consumed = steps_and_consumed(100, {0: (30, 0), 2: (28, 3), 3: (29, 0)}, 4)
    assert steps == [30, LOST_STEPS, 28, 29] and LOST_STEPS < 0
    assert consumed == 97
    assert steps_and_consumed(10, {0: (5, 1), 1: (4, 0)}, 2) == ([5, 4], 9)


def test_the_lowest_live_rank_commits_and_asks_for_the_periodic_checkpoints():
    from eddis.core.checkpoint.save import committer_of
    from eddis.core.checkpoint.schedule import requester_of

    assert committer_of([0, 2, 3]) == 0 and committer_of([3, 1, 2]) == 1
    assert requester_of(0, []) and requester_of(0, [0])
    assert not requester_of(1, []) and requester_of(1, [0])
    assert requester_of(2, [1, 0]) and not requester_of(2, [0, 3]) and not requester_of(3, [1])


@pytest.mark.parametrize("text,expected", [(None, None), ("", None), ("500", ("steps", 500)),
                                           ("600s", ("seconds", 600.0)), ("1.5S", ("seconds", 1.5))])
def test_interval_in_steps_or_seconds(text, expected):
    env = {} if text is None else {"EDDIS_CHECKPOINT_INTERVAL": text}
    assert settings.get("EDDIS_CHECKPOINT_INTERVAL", env) == expected


@pytest.mark.parametrize("text", ["0", "-3", "ten", "5m", "2.5"])
def test_a_bad_interval_names_the_forms_it_takes(text):
    # the registry's check: eddis-train and job scripts refuse it before anything starts
    with pytest.raises(ConfigError, match="EDDIS_CHECKPOINT_INTERVAL=.*'500'.*'600s'"):
        settings.check_environment({"EDDIS_CHECKPOINT_INTERVAL": text})


def test_the_request_flag_is_set_by_the_signal_handler():
    layout.clear_request()
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        assert layout.install_signal_handler()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert layout.pending_request() == "signal SIGUSR1"
        layout.request("second")
        assert layout.pending_request() == "signal SIGUSR1"
    finally:
        signal.signal(signal.SIGUSR1, previous)
        layout.clear_request()
    assert layout.pending_request() is None


def test_the_first_sigterm_is_a_request_and_the_second_ends_the_process():
    # in a child: the second SIGTERM must end the process it is sent to
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from eddis.core.checkpoint import folders as layout\n"
            "assert layout.install_signal_handler(signal.SIGTERM)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.1)\n"
            "print(layout.pending_request(), layout.requested_by_sigterm(), flush=True)\n"
            "layout.clear_request()\n"
            "print(layout.requested_by_sigterm(), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(10)\n"
            "print('survived', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == ["signal SIGTERM True", "True"], proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGTERM, proc.stderr


def test_a_request_after_shutdown_is_ignored_and_cannot_kill_the_process():
    # Python's exit resets a handler written in Python to SIGUSR1's default action (kill the
    # process), and leaves SIG_IGN as it is
    previous = signal.getsignal(signal.SIGUSR1)
    layout.clear_request()
    try:
        assert layout.install_signal_handler()
        assert layout.ignore_signal_requests()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR1)
        assert layout.pending_request() is None
        signal.signal(signal.SIGUSR1, signal.default_int_handler)
        assert not layout.ignore_signal_requests()      # somebody else's handler is kept
        assert signal.getsignal(signal.SIGUSR1) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_request_the_job_left_in_the_run_dir_is_taken_up_and_answered(tmp_path, monkeypatch):
    from eddis.smb import rundir

    monkeypatch.setenv("EDDIS_RUN_DIR", str(tmp_path))
    layout.clear_request()
    try:
        assert layout.request_from_run_dir() is None and layout.pending_request() is None
        rundir.request_checkpoint(tmp_path, "the job's time limit is near")
        assert layout.request_from_run_dir() == "the job's time limit is near"
        assert layout.pending_request() == "the job's time limit is near"
    finally:
        layout.clear_request()
    layout.answer_request(tmp_path / "ckpt-00000012", 12)
    assert rundir.checkpoint_answer(tmp_path) == {"checkpoint": str(tmp_path / "ckpt-00000012"), "step": 12,
                                                  "terminated": False}
    layout.answer_request(tmp_path / "ckpt-00000013", 13, terminated=True)
    assert rundir.checkpoint_answer(tmp_path)["terminated"] is True
    assert not rundir.training_was_complete(tmp_path)
    # refused because training had ended: the job must not take it for a checkpoint to requeue on
    layout.answer_training_complete(14)
    assert rundir.checkpoint_answer(tmp_path) is None and rundir.training_was_complete(tmp_path)


def test_checkpoint_stop_exits_with_the_requeue_status():
    stop = CheckpointStop("stopped", path="/x")
    assert isinstance(stop, SystemExit) and stop.code == REQUEUE_EXIT_STATUS == 75 and stop.path == "/x"


def test_start_tells_a_loop_what_was_done():
    fresh = Start()
    assert not fresh.resumed and fresh.step == 0 and not fresh.done(0, 0)
    start = Start("/c", step=7, epoch=1, batch=2, extra={"a": 1})
    assert start.resumed and start["step"] == 7 and start.extra == {"a": 1}
    assert start.done(0, 99) and start.done(1, 1) and not start.done(1, 2) and not start.done(2, 0)


def test_data_position_counts_the_batches_of_the_current_epoch():
    checkpoint_state.reset_position()
    checkpoint_state.note_epoch(0)
    assert checkpoint_state.data_position(3) == (0, 3)
    checkpoint_state.set_position(epoch=2, batch=3, step=11)      # resumed: 3 batches of epoch 2 done
    checkpoint_state.note_epoch(2)                                 # the loop sets the same epoch
    assert checkpoint_state.data_position(12) == (2, 4)
    assert checkpoint_state.batches_done(5) == 0
    checkpoint_state.reset_position()


def test_elastic_commits_are_persisted_in_sync_modes_only_where_something_reads_them(monkeypatch, tmp_path):
    from eddis.core.checkpoint.elastic_state import commit_folder

    monkeypatch.delenv("EDDIS_CHECKPOINT_DIR", raising=False)
    monkeypatch.setenv("EDDIS_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("EDDIS_MAX_RESTARTS", "0")
    assert commit_folder("sync") is None
    monkeypatch.setenv("EDDIS_MAX_RESTARTS", "2")
    assert commit_folder("sync") == str(tmp_path / "run" / "elastic-commits")
    assert commit_folder("allreduce") == str(tmp_path / "run" / "elastic-commits")
    monkeypatch.setenv("EDDIS_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    assert commit_folder("sync") == str(tmp_path / "ckpt")
    # easgd/hybrid survivors go on with what they hold; nothing restarts from a commit
    assert commit_folder("easgd") is None and commit_folder("hybrid") is None and commit_folder(None) is None


def test_a_model_state_without_a_distributed_optimizer_commits_in_memory_and_says_so_once(
        monkeypatch, tmp_path, caplog):
    from eddis.core.checkpoint.elastic_state import ModelState

    class PlainOptimizerState(ModelState):   # as TorchState with a plain torch optimizer
        def __init__(self, **values):
            self.model, self.optimizer = "model", "plain optimizer"
            super().__init__(**values)

        def training_mode(self):
            return None

    monkeypatch.setattr(ModelState, "_warned_in_memory", False)
    monkeypatch.delenv("EDDIS_CHECKPOINT_DIR", raising=False)
    monkeypatch.setenv("EDDIS_MODE", "sync")
    monkeypatch.setenv("EDDIS_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("EDDIS_MAX_RESTARTS", "1")
    state = PlainOptimizerState(epoch=0)
    state.epoch = 3
    for _ in range(2):
        state.commit()   # no checkpointing module: any write would fail
    assert not state.restore_commit()
    state.epoch = 5
    state.restore()
    assert state.epoch == 3
    warnings = [r.getMessage() for r in caplog.records if "stays in memory" in r.getMessage()]
    assert len(warnings) == 1 and "eddis.DistributedOptimizer(optimizer)" in warnings[0], warnings


def test_a_plain_optimizers_run_counts_its_steps_and_refuses_modes_a_tape_cannot_train():
    """A checkpoint of a plain optimizer beside a DistributedGradientTape: its step is the
    optimizer's own count (read and restored); easgd and hybrid keep their state in EDDIS's
    optimizer alone, so there it is refused with the fix."""
    from eddis.core.checkpoint.state import PlainOptimizerRun

    iterations = [7]
    run = PlainOptimizerRun("allreduce", lambda: iterations[0], lambda n: iterations.__setitem__(0, n))
    assert run.step == 7 and run.averager is None and run.balancer is None and run.global_batch is None
    run.step = 12
    assert iterations == [12]
    for mode in ("easgd", "hybrid"):
        with pytest.raises(ConfigError, match=r"mode '\w+'.*eddis.DistributedOptimizer\(optimizer\)"):
            PlainOptimizerRun(mode, lambda: 0, lambda n: None)
