"""eddis.core.progress.join's pieces that need no MPI: the SMB join board against a real server,
and the rule that names the rank that joined last."""
import pytest

from eddis import smb
from eddis.core.progress import join
from eddis.core.reduce.join_board import JoinBoard
from eddis.errors import ConfigError


@pytest.fixture
def client(tmp_path):
    run_dir = tmp_path / "run"
    smb.create_run_dir(run_dir)
    server = smb.Server(run_dir, index=0, memory=8 << 20)
    server.start()
    with smb.Client(run_dir=run_dir) as c:
        yield c
    server.stop()


def test_last_joined_is_the_rank_with_most_steps_and_of_equals_the_highest():
    assert join.last_joined([3, 4, 5]) == 2
    assert join.last_joined([5, 4, 3]) == 0
    assert join.last_joined([4, 4, 2]) == 1
    assert join.last_joined([0, 0]) == 1


def test_board_ends_only_after_the_step_every_rank_joined_at(client):
    boards = [JoinBoard(client, "units.join", r, 3) for r in range(3)]
    boards[0].publish(3)                      # rank 0 joins at step 3
    assert not boards[0].everyone_joined_by(3)
    boards[1].publish(4)
    assert boards[0].join_steps() == [3, 4, None]
    assert not boards[0].everyone_joined_by(4)   # rank 2 still trains
    boards[2].publish(5)
    assert not boards[1].everyone_joined_by(4)   # rank 2 takes part in step 5 with zeros
    assert all(b.everyone_joined_by(5) for b in boards)


def test_board_ignores_an_earlier_join_call_and_counters_left_behind(client):
    old = [JoinBoard(client, "units.reused", r, 2) for r in range(2)]
    for r, b in enumerate(old):
        b.publish(7 + r)                      # an earlier reducer of the same name
    boards = [JoinBoard(client, "units.reused", r, 2) for r in range(2)]
    assert boards[0].join_steps() == [None, None]
    boards[0].publish(2)
    boards[1].publish(3)
    assert boards[1].everyone_joined_by(3)
    for b in boards:
        b.since = 3                           # that join() ended after step 3
    assert boards[0].join_steps() == [None, None]
    boards[1].publish(5)                      # the next epoch: rank 1 joins at step 5
    assert boards[0].join_steps() == [None, 5]
    assert not boards[0].everyone_joined_by(9)
    boards[0].publish(6)
    assert boards[0].everyone_joined_by(6) and not boards[0].everyone_joined_by(5)


def test_two_open_reducers_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"2 gradient reducers .*\(optimizer.close\(\)\)"):
        join._pick([("a", None), ("b", None)], "eddis.join()")
    assert join._pick([], "eddis.join()") == (None, None)
