"""A write that counts itself in: ``Pool.write_nb(buf, start, count_in=counter)`` adds one to
``counter`` once the data has landed on the server that holds both, so that a reader that
sees the count sees the data (mode sync's ring announces its pieces so).

Stated figures: the counter gains exactly one per counted write, on every transport, for a
write of one socket request and for one of many; on the socket transport the server counts
when the write's last request lands, so a counted write costs the server the requests of
the write alone (no fetch-and-add request, no second round trip); a count that cannot be
made is the write's error, naming the counter; a counter on another server than the range,
or a range across servers, is refused before anything is sent."""
import numpy as np
import pytest

from eddis.errors import SMBValueError
from eddis.smb import Client, _core, protocol
from eddis.smb.testing import LocalServers


@pytest.fixture(params=["socket", "rdma", "mapped"])
def transport(request, monkeypatch):
    """The servers' transport and whether the client maps their memory (same node)."""
    env = {"SMB_TRANSPORT": "rdma" if request.param == "rdma" else "socket",
           "SMB_LOCAL_MAP": "1" if request.param == "mapped" else "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return request.param, env


@pytest.mark.timeout(120)
def test_a_counted_write_lands_before_its_single_count(transport):
    name, env = transport
    with LocalServers(2, memory="64M", env=env) as servers:
        with Client(servers.run_dir, expected_servers=2, timeout=10) as client:
            small = 1000
            large = 3 * _core.SOCK_PIECE_BYTES // 4 + 5   # four socket requests
            inbox = client.pool("inbox", small + large, servers=[1])
            arrived = client.counter("inbox.arrived", server=1)
            observer = client.counter("inbox.arrived", server=1)
            before = client.stats(1)["requests"]
            first = np.arange(small, dtype=np.float32)
            second = np.arange(large, dtype=np.float32) * 0.5
            requests = [inbox.write_nb(first, start=0, count_in=arrived),
                        inbox.write_nb(second, start=small, count_in=arrived)]
            for request in requests:
                request.wait()
            after = client.stats(1)["requests"]
            assert observer.read() == 2
            np.testing.assert_array_equal(inbox.read(count=small), first)
            np.testing.assert_array_equal(inbox.read(start=small), second)
            if name == "socket":
                # the writes' requests and the second stats request: no request of the counts
                pieces = 1 + -(-4 * large // _core.SOCK_PIECE_BYTES)
                assert after - before == pieces + 1, (before, after, pieces)


@pytest.mark.timeout(120)
def test_a_counted_write_is_refused_where_the_count_cannot_follow_the_data(transport):
    _, env = transport
    with LocalServers(2, memory="64M", env=env) as servers:
        with Client(servers.run_dir, expected_servers=2, timeout=10) as client:
            spread = client.pool("spread", 2000)               # half on each server
            here = client.pool("here", 1000, servers=[1])
            elsewhere = client.counter("elsewhere", server=0)
            on_one = client.counter("on-one", server=1)
            with pytest.raises(SMBValueError, match="'elsewhere'.*server 0.*server 1"):
                here.write_nb(np.ones(10, np.float32), count_in=elsewhere)
            with pytest.raises(SMBValueError, match="lie on servers \\[0, 1\\]"):
                spread.write_nb(np.ones(2000, np.float32), count_in=on_one)
            with pytest.raises(SMBValueError, match="count_in must be a Counter"):
                here.write_nb(np.ones(10, np.float32), count_in=3)
            assert on_one.read() == 0 and elsewhere.read() == 0


@pytest.mark.timeout(120)
def test_the_server_refuses_to_count_into_what_is_no_counter(monkeypatch):
    """A socket put whose descriptor names a region that is no counter (a float pool, a freed
    counter) lands its data but answers with the count's error; the server serves on."""
    env = {"SMB_TRANSPORT": "socket", "SMB_LOCAL_MAP": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with LocalServers(1, memory="64M", env=env) as servers:
        with Client(servers.run_dir, expected_servers=1, timeout=10) as client:
            pool = client.pool("data", 100)
            gone = client.counter("gone")
            gone_rid = gone._rid
            client._control(0, {"op": "region_free", "name": "counter:gone"}, "free")
            seg = pool.segments[0]
            for count_rid, message in ((seg.rid, "no counter"), (gone_rid, "unknown counter")):
                pending = client._pending()
                data = np.ones(100, np.float32)
                pending.keep = data
                client._core.post_put(pending, seg.conn, _core.buffer_address(data, False)[0],
                                      data.nbytes, seg.rid, 0, 0, 0, count_rid)
                from eddis.smb.requests import Request
                with pytest.raises(Exception, match=message):
                    Request(client, pending, "counted put", None, [0]).wait()
            np.testing.assert_array_equal(pool.read(), np.ones(100, np.float32))
            assert protocol.PUT_DESC.size == _core.WIRE_SIZES["put_desc"]
