"""What an SMB operation returns: a :class:`Request` that its caller waits for (bounded by
the client's timeout), or a :class:`Completed` one (same-node copies finish at once), or a
:class:`CountedAfter` one (a write whose count must follow it)."""
from ..errors import SMBConnectionError, SMBTimeoutError, UsageError, from_ucs_status


class Request:
    """A non-blocking SMB operation: ``wait(timeout=None)`` returns its result, ``done()`` polls."""

    def __init__(self, client, pending, description, finish=None, servers=()):
        self._client = client
        self._pending = pending
        self._description = description
        self._finish = finish
        self._servers = servers
        self._result = None
        self._completed = False

    def done(self):
        return self._completed or self._pending.done()

    def wait_done(self, timeout):
        """Drive the transport for up to ``timeout`` s or until the request is done; True once it
        is (``wait()`` then returns its result or raises its error), False while it goes on.
        Unlike ``wait()``, running out of time here gives nothing up."""
        if self._completed:
            return True
        return self._pending.wait(float(timeout)) != 1

    def wait(self, timeout=None):
        if self._completed:
            return self._result
        timeout = self._client.timeout if timeout is None else float(timeout)
        client = self._client
        rc = self._pending.wait(timeout)
        if rc == 3:
            raise UsageError(f"{self._description}: the SMB client was closed while waiting")
        if rc != 0:
            if self._pending.has_transfers:
                # A one-sided transfer that never completes means a stuck server:
                # give up on it so no late write lands in a buffer we returned.
                for conn in self._pending.inflight_conns():
                    client._core.fail_conn(conn)
            raise SMBTimeoutError(
                f"{self._description} did not complete within {timeout:g} s "
                f"(servers {sorted(set(self._servers))}); raise SMB_TIMEOUT or check the servers")
        status = self._pending.error_status
        if status != 0:
            conn = self._pending.error_conn
            code = client._core.conn_status(conn) or status
            # A send can fail on a reset connection before the transport's error callback has
            # marked it failed; mark it now, so that whoever asks which servers are lost
            # (note_lost, check_alive) sees the loss this error reports.
            client._core.fail_conn(conn, code)
            raise SMBConnectionError(
                f"{self._description}: lost SMB server {conn} ({client.address(conn)}): "
                f"{client._status_text(code)}; the server died or the network failed", code)
        replies = self._pending.replies()
        for conn, reply in zip(self._pending_conns(), replies):
            st, data = reply
            if st != 0:
                raise from_ucs_status(st, f"{self._description}: server {conn}: "
                                          f"{data.decode(errors='replace')}")
        self._result = self._finish([data for _, data in replies]) if self._finish else None
        self._completed = True
        self._pending = None
        return self._result

    def _pending_conns(self):
        return self._pending.slot_conns_list()

    def unanswered_servers(self):
        """After a timeout: the servers whose part of this request has not completed."""
        if self._pending is None:
            return []
        conns = set(self._pending.inflight_conns())
        conns.update(c for c, reply in zip(self._pending.slot_conns_list(), self._pending.replies())
                     if reply is None)
        return self._client.servers_of(conns)


class Completed:
    """A request that finished when it was issued (same-node copies)."""

    __slots__ = ("_result",)

    def __init__(self, result=None):
        self._result = result

    def done(self):
        return True

    def wait_done(self, timeout):
        return True

    def wait(self, timeout=None):
        return self._result

    def unanswered_servers(self):
        return []


class CountedAfter:
    """A write and the count that follows it once it completed (a one-sided put cannot carry
    its count to the server): the count is posted as soon as the write is seen done."""

    __slots__ = ("_write", "_counter", "_count", "_error")

    def __init__(self, write, counter):
        self._write = write
        self._counter = counter
        self._count = None
        self._error = None

    def _start_count(self):
        """Once the write is done: post the count, or keep the write's error for wait()."""
        if self._count is None and self._error is None and self._write.done():
            try:
                self._write.wait()
                self._count = self._counter.fetch_add_nb(1)
            except Exception as error:  # the write's or the count's: wait() raises it
                self._error = error

    def done(self):
        self._start_count()
        return self._error is not None or (self._count is not None and self._count.done())

    def wait_done(self, timeout):
        if self._count is None and self._error is None and not self._write.wait_done(timeout):
            return False
        self._start_count()
        return self._error is not None or self._count.wait_done(timeout)

    def wait(self, timeout=None):
        if self._count is None and self._error is None:
            self._write.wait(timeout)
            self._start_count()
        if self._error is not None:
            raise self._error
        self._count.wait(timeout)

    def unanswered_servers(self):
        return (self._count or self._write).unanswered_servers()
