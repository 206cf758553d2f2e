"""Proof of the job's token before a connection may send SMB a single request.

An smb-server's only listening port is the socket of this module's
:class:`Gate`. A peer gets nothing from it but a challenge until it has proven
that it knows the job's token; only then is the socket handed to the native
request loop. The token itself never crosses the network:

    server -> client   PROTOCOL, 32-byte nonce
    client -> server   HMAC-SHA256(token, "client" + server nonce), 32-byte nonce
    server -> client   0x00, HMAC-SHA256(token, "server" + client nonce)
                  or   0x01, 2-byte length, reason; then the server closes

The server's answer proves to the client that it reached this job's server,
not a stale one of another job on a recycled port. A peer that stays silent is
dropped after ``deadline`` seconds, and unproven peers never hold more than
``max_pending`` places, so they cannot lock out the job's own clients.

Nothing a peer does may end the gate's thread: what goes wrong with one peer
drops that peer (counted in ``stats``). Should the thread end all the same (its
``select`` failed, or a bug), :meth:`Gate.failure` says why, and the smb-server
exits naming it: a gate that no longer accepts would fail every later client
with a handshake timeout that blames the client.
"""
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
import traceback

from ..errors import SMBConnectionError, SMBPermissionError, SMBTimeoutError

log = logging.getLogger("eddis.smb.handshake")

PROTOCOL = b"EDDIS-SMB/2\n"
NONCE_BYTES = 32
PROOF_BYTES = 32
CHALLENGE_BYTES = len(PROTOCOL) + NONCE_BYTES
ANSWER_BYTES = PROOF_BYTES + NONCE_BYTES
ACCEPTED, REFUSED = 0, 1
DEFAULT_MAX_PENDING = 256
# accept() failed (out of descriptors, memory): the listener rests this long, so that the
# backlog waits instead of the gate spinning on a readable listener it cannot serve
ACCEPT_PAUSE = 0.25
ACCEPT_WARNING_EVERY = 10.0
REFUSAL_TEXT = b"wrong job token (use the token file of this job's run directory)"


def proof(token, role, nonce):
    key = token.encode() if isinstance(token, str) else bytes(token)
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


class Gate:
    """The server side: accepts, challenges, and hands proven sockets to ``adopt(fd)``."""

    def __init__(self, host, port, token, adopt, deadline=10.0, max_pending=DEFAULT_MAX_PENDING):
        self.token = token
        self.adopt = adopt
        self.deadline = float(deadline)
        self.max_pending = int(max_pending)
        self.stats = {"accepted": 0, "proven": 0, "refused": 0, "left_unproven": 0,
                      "dropped_silent": 0, "dropped_crowded": 0, "dropped_failed": 0,
                      "accept_failed": 0}
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, int(port)))
        self._listener.listen(1024)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._pending = {}      # socket -> (opened, nonce, bytes received)
        self._stop = threading.Event()
        self._thread = None
        self._died = None           # why the thread ended on its own
        self._accept_resumes = None  # when a listener paused after a failed accept() listens again
        self._accept_warned = -ACCEPT_WARNING_EVERY

    def start(self):
        self._thread = threading.Thread(target=self._run, name="smb-server-gate", daemon=True)
        self._thread.start()

    def failure(self):
        """None while the gate serves (or was stopped); else why its thread ended on its own."""
        thread = self._thread
        if thread is None or thread.is_alive() or self._stop.is_set():
            return None
        return self._died or "its thread ended without being asked to stop"

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        for sock in list(self._pending):
            self._drop(sock)
        try:
            self._selector.unregister(self._listener)
        except (KeyError, ValueError):
            pass
        self._listener.close()
        self._selector.close()

    # ------------------------------------------------------------ loop
    def _run(self):
        try:
            self._serve()
        except BaseException as exc:   # a bug of ours: the server must end, naming it
            self._died = f"{type(exc).__name__}: {exc} (at {_where(exc)})"
            log.error("smb-server: the handshake thread died", exc_info=True)

    def _serve(self):
        while not self._stop.is_set():
            try:
                events = self._selector.select(timeout=0.25)
            except OSError as exc:
                self._died = f"select() failed: {exc}"
                return
            for key, _ in events:
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                elif sock in self._pending:
                    # (not pending any more: dropped earlier in this batch, crowded out by an
                    # accept; its descriptor may already belong to a newer socket)
                    self._receive_or_drop(sock)
            now = time.monotonic()
            self._sweep(now)
            if self._accept_resumes is not None and now >= self._accept_resumes:
                self._accept_resumes = None
                self._selector.register(self._listener, selectors.EVENT_READ, None)

    def _accept(self):
        for _ in range(64):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._pause_accepting(exc)
                return
            self.stats["accepted"] += 1
            if not self._challenge(sock):
                continue
            if len(self._pending) > self.max_pending:
                oldest = min(self._pending, key=lambda s: self._pending[s][0])
                self.stats["dropped_crowded"] += 1
                self._drop(oldest)

    def _challenge(self, sock):
        """Send a new peer its challenge and wait for its answer; False if it is gone already."""
        nonce = os.urandom(NONCE_BYTES)
        try:
            sock.setblocking(False)
            if sock.send(PROTOCOL + nonce) != CHALLENGE_BYTES:
                sock.close()
                return False
            self._selector.register(sock, selectors.EVENT_READ, None)
        except (OSError, ValueError, KeyError) as exc:
            log.debug("smb-server: a new peer is gone before its challenge: %s", exc)
            sock.close()
            return False
        self._pending[sock] = (time.monotonic(), nonce, b"")
        return True

    def _pause_accepting(self, exc):
        """accept() failed (out of descriptors, memory): the backlog waits a moment, the
        peers already pending are served on."""
        self.stats["accept_failed"] += 1
        now = time.monotonic()
        if now - self._accept_warned >= ACCEPT_WARNING_EVERY:
            self._accept_warned = now
            log.warning("smb-server: accept failed: %s; new connections wait (%d failed accepts "
                        "so far; raise the open-files limit, ulimit -n, if this goes on)", exc,
                        self.stats["accept_failed"])
        self._selector.unregister(self._listener)
        self._accept_resumes = now + ACCEPT_PAUSE

    def _receive_or_drop(self, sock):
        try:
            self._receive(sock)
        except Exception:   # one peer's trouble must not end the gate for every later client
            log.exception("smb-server: the handshake of a peer failed; dropping it")
            self.stats["dropped_failed"] += 1
            self._drop(sock)

    def _receive(self, sock):
        opened, nonce, got = self._pending[sock]
        try:
            data = sock.recv(ANSWER_BYTES - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.stats["left_unproven"] += 1
            self._drop(sock)
            return
        got += data
        if len(got) < ANSWER_BYTES:
            self._pending[sock] = (opened, nonce, got)
            return
        answer, client_nonce = got[:PROOF_BYTES], got[PROOF_BYTES:]
        self._selector.unregister(sock)
        del self._pending[sock]
        if not hmac.compare_digest(answer, proof(self.token, b"client", nonce)):
            self.stats["refused"] += 1
            try:
                sock.send(bytes([REFUSED]) + struct.pack("<H", len(REFUSAL_TEXT)) + REFUSAL_TEXT)
            except OSError:
                pass
            sock.close()
            return
        try:
            sock.setblocking(True)
            sock.settimeout(self.deadline)
            sock.sendall(bytes([ACCEPTED]) + proof(self.token, b"server", client_nonce))
        except OSError:
            sock.close()
            return
        self.stats["proven"] += 1
        fd = sock.detach()
        try:
            self.adopt(fd)
        except Exception as exc:   # the core closed fd; the loop must keep running
            log.warning("smb-server: cannot take a proven connection: %s", exc)

    def _sweep(self, now):
        for sock, (opened, _, _) in list(self._pending.items()):
            if now - opened > self.deadline:
                self.stats["dropped_silent"] += 1
                self._drop(sock)

    def _drop(self, sock):
        self._pending.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()


def _where(exc):
    """file:line of the innermost frame of exc's traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown place"


def connect(host, port, token, timeout):
    """The client side: a connected socket's descriptor once both sides proved the token."""
    where = f"smb-server at {host}:{port}"
    deadline = time.monotonic() + float(timeout)
    try:
        sock = socket.create_connection((host, int(port)), timeout=max(0.1, float(timeout)))
    except socket.timeout:
        raise SMBTimeoutError(f"cannot reach {where} within {timeout:g} s; is it running "
                              f"(see the run directory) and is the network up?") from None
    except OSError as exc:
        raise SMBConnectionError(f"cannot reach {where}: {exc.strerror or exc}; is it running "
                                 f"(see the run directory)?", exc.errno or 0) from None
    try:
        challenge = _receive_exactly(sock, CHALLENGE_BYTES, deadline, where)
        if not challenge.startswith(PROTOCOL):
            raise SMBConnectionError(
                f"{where} does not speak {PROTOCOL.strip().decode()} (an older EDDIS, or not an "
                f"smb-server); check the address file of the run directory")
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(proof(token, b"client", challenge[len(PROTOCOL):]) + nonce)
        verdict = _receive_exactly(sock, 1, deadline, where)[0]
        if verdict != ACCEPTED:
            length = struct.unpack("<H", _receive_exactly(sock, 2, deadline, where))[0]
            reason = _receive_exactly(sock, length, deadline, where).decode(errors="replace")
            raise SMBPermissionError(f"{where} refused the connection: {reason}")
        answer = _receive_exactly(sock, PROOF_BYTES, deadline, where)
        if not hmac.compare_digest(answer, proof(token, b"server", nonce)):
            raise SMBPermissionError(
                f"{where} does not know this job's token: it belongs to another job (a stale "
                f"address file?); start the job's own servers")
        return sock.detach()
    except socket.timeout:
        raise SMBTimeoutError(f"{where} did not finish the token handshake within {timeout:g} s") from None
    except OSError as exc:
        if isinstance(exc, (SMBPermissionError, SMBConnectionError, SMBTimeoutError)):
            raise
        raise SMBConnectionError(f"lost {where} during the token handshake: {exc}", exc.errno or 0) from None
    finally:
        sock.close()


def _receive_exactly(sock, n, deadline, where):
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:  # the caller names the timeout, as for a recv() that ran out
            raise SMBTimeoutError(f"{where} did not finish the token handshake in time")
        sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise SMBConnectionError(f"{where} closed the connection during the token handshake "
                                     f"(too many unproven connections, or it is shutting down)")
        data += chunk
    return data
