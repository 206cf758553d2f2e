"""The global learning counter on 4 real MPI ranks in mode hybrid, on two named nodes
(EDDIS_HOSTNAME per rank, one smb-server per name, as tests/test_sync_hierarchy.py):
ranks {0, 1} on hA and {2, 3} on hB form the two groups (lockstep units).

- a unit's claim counters (where its leader posts a claim for the members to read)
  live on the leader's node, not on the server its name hashes to, so that the
  members' polls stay off the network between nodes;
- the leader claims the next chunk ahead, in the background: the job still runs
  exactly the total, every rank's steps add up to it, and at a step boundary the
  counter less the leaders' unused iterations (what a checkpoint records as
  consumed) equals the steps the ranks have begun, with claims under way;
- a rank that leaves the loop early gives its claim made ahead back to the counter;
- the centre of easgd/hybrid crosses the network here (no rank maps the other node's
  server), so EDDIS_EASGD_OVERLAP=auto overlaps the exchanges.

This file is also the worker: ``mpirun -n 4 python tests/test_progress_units.py``.
"""
import json
import os
import sys

import pytest

HOSTS = ["hA", "hA", "hB", "hB"]
TOTAL = 96
CHECK_AT = 5      # the step boundary where the counter is checked against the steps begun
LEAVE_AT = 3      # the early-leaving run: every rank leaves its loop after this many steps


def worker():
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ["EDDIS_HOSTNAME"] = HOSTS[rank]
    import time

    from eddis.core.checkpoint import state as checkpoint_state
    from eddis.core import lifecycle
    from eddis.core.hetero import averaging
    from eddis.core.progress import counter as progress
    from eddis.core.comm import collectives, connection, groups

    lifecycle.init()
    ctl = progress.configure(total=TOTAL, chunk=1, mode="hybrid")
    client = connection.smb_client()
    leader_home = client.servers_on_hosts([HOSTS[ctl.unit_leader]])
    steps, consistent = 0, None
    group = groups.group_comm()
    while not ctl.should_stop():
        time.sleep(0.002 * (1 + rank))  # the groups differ in speed: claims interleave
        collectives.barrier(comm=group, what="test: the group's step")   # as its reduction does
        steps += 1
        if steps == CHECK_AT:
            mine = checkpoint_state.progress_of_rank()
            parts = collectives.allgather_object(mine, what="test: progress parts")
            counter = ctl.counter.read()   # every leader settled its claim before the gather
            collectives.barrier(what="test: counter read")
            consistent = {"counter": counter, "unused": sum(u for _, u in parts),
                          "begun": sum(d for d, _ in parts)}
    counts = progress.progress_counts()
    final = ctl.counter.read()
    progress.reset()

    # a second run whose ranks all leave the loop early, each leader with a claim made ahead
    early = progress.configure(total=TOTAL, chunk=1, mode="hybrid")
    left = 0
    while left < LEAVE_AT and not early.should_stop():
        collectives.barrier(comm=group, what="test: the group's step")
        left += 1
    had_ahead = early._ahead is not None
    collectives.barrier(what="test: every rank left its loop")
    progress.reset()   # close(): the claims made ahead go back
    collectives.barrier(what="test: every rank closed")
    after_early = early.counter.read()
    crosses = averaging.centre_crosses_network(client)
    os.write(1, ("RESULT " + json.dumps({
        "rank": rank, "steps": steps, "counts": counts, "final": final, "consistent": consistent,
        "leader": ctl.leader, "unit_leader": ctl.unit_leader, "leader_home": leader_home,
        "posted_servers": [ctl._posted.server, ctl._posted_value.server],
        "hashed_servers": [client.server_for("counter:" + c.name) for c in (ctl._posted, ctl._posted_value)],
        "early_left": left, "early_had_ahead": had_ahead, "early_counter": after_early,
        "centre_crosses": crosses}) + "\n").encode())
    lifecycle.shutdown()


_runs = []


@pytest.fixture
def results(run_mpi):
    """One launch for the module's tests (they all read the same run)."""
    if not _runs:
        _runs.append(launch(run_mpi))
    return _runs[0]


def launch(run_mpi):
    from conftest import PYTHON
    from eddis.smb.testing import LocalServers

    with LocalServers(2, memory="16M", hostnames=["hA", "hB"]) as servers:
        env = {"EDDIS_RUN_DIR": str(servers.run_dir), "EDDIS_EMBEDDED_SERVER": "0", "EDDIS_MODE": "hybrid"}
        proc = run_mpi(4, [PYTHON, __file__], env=env, timeout=120, check=True)
    found = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(found) == 4, proc.stdout[-3000:]
    return sorted(found, key=lambda r: r["rank"])


@pytest.mark.timeout(180)
def test_a_units_claim_counters_live_on_its_leaders_node(results):
    for r in results:
        assert r["unit_leader"] == (0 if r["rank"] < 2 else 2), r
        assert r["posted_servers"] == [r["leader_home"][0]] * 2, r
    # the names alone would have put them on the other node's server (what the test guards)
    assert any(r["hashed_servers"] != r["posted_servers"] for r in results), results


@pytest.mark.timeout(180)
def test_claims_made_ahead_hand_out_exactly_the_total(results):
    for r in results:
        assert r["final"] == TOTAL, r
        assert sum(r["counts"]) == TOTAL, r
        assert r["counts"][r["rank"]] == r["steps"], r
    # the members of a group step with their leader
    assert results[0]["steps"] == results[1]["steps"] and results[2]["steps"] == results[3]["steps"], results


@pytest.mark.timeout(180)
def test_the_counter_less_unused_claims_is_the_steps_begun(results):
    for r in results:
        c = r["consistent"]
        assert c is not None, r
        assert c["counter"] - c["unused"] == c["begun"], c


@pytest.mark.timeout(180)
def test_a_claim_made_ahead_goes_back_when_the_loop_is_left_early(results):
    for r in results:
        assert r["early_left"] == LEAVE_AT, r
        assert r["early_had_ahead"] == r["leader"], r   # leaders claim, members read the posts
        assert r["early_counter"] == 4 * LEAVE_AT, r      # what the ranks ran, nothing more


@pytest.mark.timeout(180)
def test_the_centre_crosses_the_network_between_named_nodes(results):
    assert all(r["centre_crosses"] for r in results), results


if __name__ == "__main__":
    sys.exit(worker())
