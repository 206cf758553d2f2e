"""Mirrored pools and counters (eddis.smb.mirror) outlive one lost smb-server.

Real smb-server processes (eddis.smb.testing.LocalServers); one is killed with SIGKILL (or
stopped with SIGSTOP, which only a timeout tells) while the client holds a mirrored pool
and counter. Stated: every element keeps its value and takes updates on the live copy,
the counter goes on from its value, and losing both copies of something is a clear error.
"""
import signal

import numpy as np
import pytest

from launch_helpers import stop_every_thread

from eddis.errors import SMBConnectionError, SMBValueError
from eddis.smb import Client
from eddis.smb.testing import LocalServers

LENGTH = 1000   # 333 / 333 / 334 elements per server of 3


def fill(pool, slots):
    for slot in range(slots):
        pool.write(np.arange(LENGTH, dtype=np.float32) + 1000 * slot, slot=slot)


# how the client reaches the servers: over sockets or one-sided (rdma, here over UCX's shared
# memory: the servers' fake node names keep the client from mapping them), or by mapping them
TRANSPORTS = {"remote": (["m0", "m1", "m2"], "socket"), "rdma": (["m0", "m1", "m2"], "rdma"),
              "same-node": (None, "socket")}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_mirrored_pool_and_counter_outlive_a_killed_server(transport, monkeypatch):
    hostnames, kind = TRANSPORTS[transport]
    monkeypatch.setenv("SMB_TRANSPORT", kind)
    with LocalServers(3, memory="16M", hostnames=hostnames, env={"SMB_TRANSPORT": kind}) as servers:
        client = Client(servers.run_dir, expected_servers=3, timeout=20)
        assert client.transport == kind
        try:
            pool = client.pool("centre", LENGTH, slots=2, mirrored=True)
            counter = client.counter("progress", initial=5, mirrored=True)
            fill(pool, 2)
            pool.axpy(0, 1, 0.5)
            assert counter.fetch_add(10) == 5
            want = np.arange(LENGTH, dtype=np.float32) * 1.5 + 500
            np.testing.assert_array_equal(pool.read(slot=0), want)
            # the counter's own server is lost, and one server of the pool
            servers.kill(counter.server)
            assert counter.fetch_add(3) == 15
            assert client.lost_servers == {counter.server}
            np.testing.assert_array_equal(pool.read(slot=0), want)
            pool.axpy(0, 1, 1.0)
            want += np.arange(LENGTH, dtype=np.float32) + 1000
            np.testing.assert_array_equal(pool.read(slot=0), want)
            # the non-blocking calls answer done() and wait_done() as a Pool's requests do
            update = pool.axpy_nb(0, 1, 0.0)
            assert update.wait_done(20) and update.done()
            update.wait()
            read = pool.read_nb(slot=0)
            assert read.wait_done(20) and read.done()
            np.testing.assert_array_equal(read.wait(), want)
            # a piece that straddles the lost server's segment
            pool.write(np.full(400, 7, dtype=np.float32), slot=1, start=300)
            got = pool.read(slot=1, start=250, count=500)
            np.testing.assert_array_equal(got[50:450], 7)
            np.testing.assert_array_equal(got[:50], np.arange(250, 300) + 1000)
            assert counter.read() == 18
            counter.wait_for(18, 5)
            # a second server lost: some elements have no copy left
            servers.kill((counter.server + 1) % 3)
            with pytest.raises(SMBConnectionError, match=r"both copies of elements \[\d+, \d+\) are lost"):
                pool.read(slot=0)
            with pytest.raises(SMBConnectionError, match="counter 'progress' fetch_add: both copies are lost"):
                counter.fetch_add(1)
        finally:
            client.close()


def test_a_mirrored_counters_compare_swap_keeps_both_copies_alike():
    """The checkpoint schedule's saves counter: a compare-and-swap begins a save, a fetch_add
    of another client may come between its two copies; after losing the primary the mirror
    holds the same value and decides the next swap."""
    with LocalServers(2, memory="16M", hostnames=["c0", "c1"]) as servers:
        client = Client(servers.run_dir, expected_servers=2, timeout=20)
        try:
            saves = client.counter("saves", initial=0, server=0, mirrored=True)
            assert saves.compare_swap(0, 1) == 0          # swapped
            assert saves.compare_swap(0, 1) == 1          # not: the value stays
            saves.fetch_add(1 << 40)
            assert saves.compare_swap(1, 2) == 1 + (1 << 40)
            servers.kill(0)
            assert saves.read() == 1 + (1 << 40)          # the mirror's copy
            assert saves.compare_swap(1 + (1 << 40), 2 + (1 << 40)) == 1 + (1 << 40)
            assert saves.read() == 2 + (1 << 40) and client.lost_servers == {0}
        finally:
            client.close()


@pytest.mark.parametrize("lost", ["primary", "mirror"])
def test_a_mirrored_counter_first_reached_after_a_server_died_uses_its_live_copy(lost):
    """The checkpoint schedule's counters are set up at a rank's first step boundary, which a
    slow rank may reach after a node died: a client that has not yet seen the loss attaches
    to the live copy, with the value the other clients left there."""
    with LocalServers(3, memory="16M", hostnames=["f0", "f1", "f2"]) as servers:
        first = Client(servers.run_dir, expected_servers=3, timeout=20)
        late = Client(servers.run_dir, expected_servers=3, timeout=20)
        try:
            requests = first.counter("requests", initial=0, server=1, mirrored=True)
            assert requests.fetch_add(4) == 0
            dead = 1 if lost == "primary" else 2
            servers.kill(dead)
            again = late.counter("requests", initial=0, server=1, mirrored=True)
            assert late.lost_servers == {dead}
            assert again.read() == 4
            assert again.fetch_add(1) == 4
            assert requests.fetch_add(0) == 5 and first.lost_servers == {dead}
            # a counter no client had: set up on its live server alone
            fresh = late.counter("saves", initial=7, server=dead, mirrored=True)
            assert fresh.fetch_add(1) == 7 and fresh.read() == 8
            # both of a counter's servers lost: a clear error at setup
            servers.kill(0)
            home = 0 if lost == "primary" else 2
            with pytest.raises(SMBConnectionError, match=rf"counter 'target' setup: both copies are lost "
                                                         rf"\(smb-servers {home} and {(home + 1) % 3}\)"):
                late.counter("target", server=home, mirrored=True)
        finally:
            late.close()
            first.close()


@pytest.mark.parametrize("kind", ["socket", "rdma"])
def test_a_stopped_server_is_given_up_after_the_timeout(kind, monkeypatch):
    monkeypatch.setenv("SMB_TRANSPORT", kind)
    with LocalServers(2, memory="16M", hostnames=["s0", "s1"], env={"SMB_TRANSPORT": kind}) as servers:
        client = Client(servers.run_dir, expected_servers=2, timeout=2)
        assert client.transport == kind
        try:
            pool = client.pool("centre", LENGTH, slots=2, mirrored=True)
            counter = client.counter("steps", server=1, mirrored=True)
            fill(pool, 2)
            stop_every_thread(servers.procs[1].pid)
            try:
                pool.axpy(0, 1, 1.0)          # server 1 never answers: given up, server 0 has a copy
                assert client.lost_servers == {1}
                want = 2 * np.arange(LENGTH, dtype=np.float32) + 1000
                np.testing.assert_array_equal(pool.read(slot=0), want)
                assert counter.fetch_add(2) == 0 and counter.read() == 2
                # a counter first reached now: its copy on server 1 is not waited for again
                late = client.counter("late", initial=3, server=1, mirrored=True)
                assert late.fetch_add(1) == 3 and late.read() == 4
            finally:
                servers.procs[1].send_signal(signal.SIGCONT)
        finally:
            client.close()


def test_mirroring_needs_two_servers():
    with LocalServers(1, memory="16M") as servers:
        client = Client(servers.run_dir, expected_servers=1, timeout=20)
        try:
            with pytest.raises(SMBValueError, match="needs at least 2 servers"):
                client.pool("x", 10, mirrored=True)
            with pytest.raises(SMBValueError, match="needs at least 2 servers"):
                client.counter("x", mirrored=True)
        finally:
            client.close()
