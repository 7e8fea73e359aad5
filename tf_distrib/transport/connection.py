"""One authenticated TCP link to a peer: a sender thread, a receiver thread, heartbeats.

The caller posts the buffer a frame must land in (`post`) and queues frames to send
(`send`); both return a `Request` to `wait` for. The receiver thread reads every frame
the peer sends, so heartbeats keep arriving while the caller is busy elsewhere; `wait`
raises `PeerLostError` as soon as the peer closes, aborts, or sends nothing (not even
a heartbeat) for `peer_timeout` seconds: a SIGSTOPped or frozen worker is told apart
from one that is merely busy (its sender thread keeps beating).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

import numpy as np

from tf_distrib.transport import wire
from tf_distrib.transport.errors import Peer, PeerLostError, ProtocolError, TransportError

# Loopback moves ~8 MB in flight with these; TCP autotuning does as well across hosts.
_SOCKET_BUFFER_BYTES = 4 << 20
# Frames this small go out from the calling thread when nothing is queued before them.
_DIRECT_BYTES = 64 << 10
_CLOSE = object()


def _bytes(value) -> memoryview:
    """A flat byte view (numpy's bfloat16 has no buffer format of its own)."""
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).view(np.uint8)
    return memoryview(value).cast("B")


class Request:
    """A frame to send or to receive; `Connection.wait` returns once it is done."""

    __slots__ = ("key", "views", "done", "error", "incoming")

    def __init__(self, key, views, incoming: bool = False):
        self.key, self.views, self.incoming = key, views, incoming
        self.done = threading.Event()
        self.error: TransportError | None = None


class Connection:
    """An authenticated link to `peer`.

    Args:
        sock: The connected, authenticated socket (the connection owns it).
        peer: Who is at the other end.
        peer_timeout: Seconds of silence after which the peer counts as lost.
    """

    def __init__(self, sock: socket.socket, peer: Peer, peer_timeout: float):
        self.peer = peer
        self.peer_timeout = peer_timeout
        self._interval = min(1.0, peer_timeout / 4)
        for option, value in ((socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES),
                              (socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)):
            sock.setsockopt(socket.SOL_SOCKET, option, value)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Both threads poll, so that they notice close(). (A timeout makes the descriptor
        # non-blocking, and dup()'ed descriptors share that: each object needs its own.)
        sock.settimeout(self._interval)
        self._sock = sock
        self._rsock = sock.dup()
        self._rsock.settimeout(self._interval)
        self.last_heard = time.monotonic()
        self.waiting = False  # inside wait(): the flight recorder shows whom we wait for
        self.waited = 0.0  # seconds spent in wait() for frames from the peer
        self.failure: TransportError | None = None
        self._closing = False
        self._lock = threading.Condition()
        self._posted: Request | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writing = threading.Lock()  # one frame at a time on the socket
        self._queued = 0  # frames in the outbox or being written by the sender thread
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"tf_distrib-send-{peer.rank}",
                             daemon=True),
            threading.Thread(target=self._receive_loop, name=f"tf_distrib-recv-{peer.rank}",
                             daemon=True)]
        for thread in self._threads:
            thread.start()

    # The caller's side --------------------------------------------------------------

    def send(self, kind: wire.Kind, seq: int, part: int, views=()) -> Request:
        """Sends a frame whose payload is `views` (sent back to back, not copied).

        Small frames with nothing queued before them go out at once from the calling
        thread (a thread hand-off costs ~50 us, most of a small collective); others are
        queued for the sender thread.
        """
        request = Request((kind, seq, part), [_bytes(v) for v in views])
        if self.failure is not None:
            request.error = self.failure
            request.done.set()
            return request
        with self._writing:
            if self._queued == 0 and sum(len(v) for v in request.views) <= _DIRECT_BYTES:
                try:
                    self._write(request)
                except OSError as e:
                    self._fail(self._send_failure(e))
                    request.error = self.failure
                request.done.set()
                return request
            self._queued += 1
        self._outbox.put(request)
        return request

    def post(self, kind: wire.Kind, seq: int, part: int, view) -> Request:
        """Asks the receiver thread to read the frame (kind, seq, part) into `view`."""
        request = Request((kind, seq, part), [_bytes(view)], incoming=True)
        with self._lock:
            if self.failure is not None:
                request.error = self.failure
                request.done.set()
            else:
                self._posted = request
                self._lock.notify_all()
        return request

    def wait(self, request: Request) -> None:
        """Returns when `request` is done; raises if it failed or the peer is lost."""
        self.waiting = True
        began = time.perf_counter()
        try:
            while not request.done.wait(self._interval):
                self.check_alive()
        finally:
            self.waiting = False
            if request.incoming:
                self.waited += time.perf_counter() - began
        if request.error is not None:
            raise request.error

    def check_alive(self) -> None:
        """Raises the connection's failure, or PeerLostError if the peer fell silent."""
        if self.failure is not None:
            raise self.failure
        silent = time.monotonic() - self.last_heard
        if silent > self.peer_timeout:
            self._fail(PeerLostError(
                f"{self.peer} sent nothing for {silent:.0f} s, more than the transport's peer "
                f"timeout of {self.peer_timeout:g} s: it is stopped (SIGSTOP), frozen, or "
                "unreachable.", self.peer))
            raise self.failure

    def abort(self, message: str) -> Request:
        """Tells the peer why this worker gives up (best effort), then fails the link.

        Returns:
            The ABORT frame's request: done once it is sent, or once the link failed.
        """
        payload = message.encode("utf-8", "replace")[:wire.MAX_CONTROL_PAYLOAD]
        request = Request((wire.Kind.ABORT, 0, 0), [memoryview(payload)])
        with self._writing:
            self._queued += 1
        self._outbox.put(request)
        self._outbox.put(_CLOSE)
        return request

    def close(self, timeout: float = 2.0) -> None:
        """Says goodbye and closes once the peer has too (or after `timeout`).

        Reading until the peer's goodbye matters: closing a socket with unread bytes
        sends a reset, which could discard the last frames the peer has not read yet.
        """
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._outbox.put(_CLOSE)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for s in (self._sock, self._rsock):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    # The threads --------------------------------------------------------------------

    def _fail(self, error: TransportError) -> None:
        with self._lock:
            if self.failure is None and not self._closing:
                self.failure = error
            posted, self._posted = self._posted, None
            self._lock.notify_all()
        pending = [posted] if posted is not None else []
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Request):
                pending.append(item)
        for request in pending:
            request.error = self.failure or error
            request.done.set()
        # Unblocks a sender stuck on a peer that stopped reading.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def _send_loop(self) -> None:
        try:
            while True:
                try:
                    item = self._outbox.get(timeout=self._interval)
                except queue.Empty:
                    with self._writing:
                        self._send_all(memoryview(wire.header(wire.Kind.HEARTBEAT)))
                    continue
                if item is _CLOSE:
                    with self._writing:
                        self._send_all(memoryview(wire.header(wire.Kind.BYE)))
                        self._sock.shutdown(socket.SHUT_WR)
                    return
                with self._writing:
                    self._write(item)
                    self._queued -= 1
                item.done.set()
        except OSError as e:
            self._fail(self._send_failure(e))

    def _send_failure(self, error: OSError) -> PeerLostError:
        return PeerLostError(f"sending to {self.peer} failed ({error.strerror or error}): it "
                             "exited or its connection broke.", self.peer)

    def _write(self, request: Request) -> None:
        """Writes one frame (the caller holds `_writing`); a small one in one system call."""
        kind, seq, part = request.key
        length = sum(len(v) for v in request.views)
        head = wire.header(kind, seq, part, length)
        if length <= _DIRECT_BYTES:
            self._send_all(memoryview(b"".join([head, *request.views])))
            return
        self._send_all(memoryview(head))
        for view in request.views:
            self._send_all(view)

    def _send_all(self, view: memoryview) -> None:
        """Sends `view`, waiting as long as it takes a peer to read (its liveness is the
        waiters' to judge), until the connection fails or closes."""
        sent = 0
        while sent < len(view):
            try:
                sent += self._sock.send(view[sent:])
            except TimeoutError:
                if self.failure is not None:
                    raise OSError(f"the connection to {self.peer} failed") from None
        return

    def _receive_loop(self) -> None:
        head = bytearray(wire.HEADER.size)
        try:
            while True:
                if not self._read_into(memoryview(head)):
                    return
                kind, seq, part, length = wire.parse_header(bytes(head), self.peer)
                if kind == wire.Kind.HEARTBEAT:
                    continue
                if kind == wire.Kind.BYE:
                    raise PeerLostError(f"{self.peer} closed its transport: it finished "
                                        "training, or is shutting down.", self.peer)
                if kind == wire.Kind.ABORT:
                    message = bytearray(length)
                    self._read_into(memoryview(message))
                    raise PeerLostError(f"{self.peer} gave up: "
                                        f"{message.decode('utf-8', 'replace')}", self.peer)
                if kind not in (wire.Kind.DATA, wire.Kind.READY):
                    raise ProtocolError(f"{self.peer} sent an unexpected {kind.name} frame.")
                request = self._wait_posted()
                if request is None:
                    return
                if request.key != (kind, seq, part) or len(request.views[0]) != length:
                    raise ProtocolError(
                        f"{self.peer} sent {kind.name} frame {seq}/{part} of {length} bytes, "
                        f"while this worker expects {request.key[0].name} frame "
                        f"{request.key[1]}/{request.key[2]} of {len(request.views[0])} bytes: "
                        "the workers run different models, bucket sizes or code.")
                if not self._read_into(request.views[0]):
                    return
                with self._lock:
                    self._posted = None
                request.done.set()
        except TransportError as e:
            self._fail(e)
        except ConnectionResetError:
            self._fail(PeerLostError(f"{self.peer} closed the connection: it exited or was "
                                     "killed.", self.peer))
        except OSError as e:
            self._fail(PeerLostError(f"receiving from {self.peer} failed ({e.strerror or e}).",
                                     self.peer))

    def _wait_posted(self) -> Request | None:
        with self._lock:
            while self._posted is None and not self._closing:
                self._lock.wait(self._interval)
            return self._posted

    def _read_into(self, view: memoryview) -> bool:
        """Fills `view`; False once closing. Raises PeerLostError on a truncated frame."""
        got = 0
        while got < len(view):
            try:
                n = self._rsock.recv_into(view[got:])
            except TimeoutError:
                if self._closing:
                    return False
                continue
            if n == 0:
                if self._closing and got == 0:
                    return False
                raise PeerLostError(
                    f"{self.peer} closed the connection"
                    + (f" in the middle of a frame ({got} of {len(view)} bytes)." if got
                       else ": it exited or was killed."), self.peer)
            got += n
            self.last_heard = time.monotonic()
        return True
