"""Property-based tests (Hypothesis) of the transport's frame parser, receiver and handshake.

Whatever a peer or a stranger sends (random bytes, truncations, bit flips, oversized
lengths, frames of another collective, a handshake recorded from another connection or
another job), the result is a TransportError naming them, promptly: never a crash, a
hang, a large allocation, a completed handshake without the secret, or bytes landing in a
buffer posted for another frame (which would sum the wrong data).
"""

import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tf_distrib.transport import wire
from tf_distrib.transport.connection import Connection
from tf_distrib.transport.errors import (
    AuthenticationError,
    Peer,
    PeerLostError,
    ProtocolError,
    TransportError,
)

EXAMPLES = 2000
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
PEER = Peer(1, "worker:1", "198.18.0.2:4000")
SECRET = b"s" * 32
# What the receiver waits for: DATA frame 3/1 of 32 bytes.
SEQ, PART, PAYLOAD = 3, 1, bytes(range(1, 33))
GOOD_FRAME = wire.header(wire.Kind.DATA, SEQ, PART, len(PAYLOAD)) + PAYLOAD


@pytest.fixture(autouse=True)
def no_thread_dies():
    """A receiver thread that died of anything but a TransportError fails the test."""
    died = []
    previous, threading.excepthook = threading.excepthook, died.append
    yield
    threading.excepthook = previous
    assert not died, died[0].exc_value


def _frame(kind, seq, part, payload, length=None):
    return wire.header(kind, seq, part, len(payload) if length is None else length) + payload


_frames = st.one_of(
    st.builds(_frame, st.sampled_from(wire.Kind), st.integers(0, 5), st.integers(0, 3),
              st.binary(max_size=40)),
    # Lengths that lie: oversized (a huge allocation if trusted), or not the payload's.
    st.builds(_frame, st.sampled_from(wire.Kind), st.just(SEQ), st.just(PART),
              st.binary(max_size=40),
              st.one_of(st.integers(0, 64), st.just(1 << 40), st.just((1 << 64) - 1))),
    st.just(wire.header(wire.Kind.HEARTBEAT)),
    st.just(GOOD_FRAME),
    st.binary(min_size=1, max_size=60))


@st.composite
def _streams(draw):
    """Bytes a peer sends: frames and noise, perhaps cut short, perhaps with a flipped bit."""
    stream = bytearray(b"".join(draw(st.lists(_frames, min_size=1, max_size=4))))
    if draw(st.booleans()):
        bit = draw(st.integers(0, len(stream) * 8 - 1))
        stream[bit // 8] ^= 1 << (bit % 8)
    return bytes(stream[:draw(st.integers(0, len(stream)))])


def _expected_outcome(stream: bytes) -> bytes | None:
    """The payload a correct receiver accepts from `stream`, or None (it must fail).

    Only a whole frame whose header is exactly the one posted (after heartbeats) lands
    in the buffer. Its payload is taken as sent: a bit flipped inside a payload in
    transit is TCP's checksum's to catch (the transport adds none, as NCCL and gloo).
    """
    head = wire.HEADER.size
    while stream[:head] == wire.header(wire.Kind.HEARTBEAT):
        stream = stream[head:]
    whole = len(GOOD_FRAME)
    if stream[:head] == GOOD_FRAME[:head] and len(stream) >= whole:
        return stream[head:whole]
    return None


def test_any_header_parses_to_a_known_bounded_frame_or_is_refused():
    @FUZZ
    @given(st.one_of(st.binary(min_size=24, max_size=24),
                     st.builds(lambda kind, seq, part, length, version: struct.pack(
                         "!4sBBHQQ", wire.MAGIC, version, kind, part, seq, length),
                         st.integers(0, 255), st.integers(0, 2**64 - 1), st.integers(0, 2**16 - 1),
                         st.integers(0, 2**64 - 1), st.sampled_from([wire.VERSION, 0, 2]))))
    def check(raw):
        try:
            kind, _, _, length = wire.parse_header(raw, PEER)
        except ProtocolError as e:
            assert str(PEER) in str(e)
            return
        assert raw[:4] == wire.MAGIC and raw[4] == wire.VERSION
        assert kind == wire.Kind.DATA or length <= wire.MAX_CONTROL_PAYLOAD

    check()


def test_any_stream_gives_the_exact_frame_or_an_error_naming_the_peer_promptly():
    @FUZZ
    @given(_streams())
    def check(stream):
        ours, theirs = socket.socketpair()
        connection = Connection(ours, PEER, peer_timeout=5.0)
        target = np.zeros(len(PAYLOAD), np.uint8)
        request = connection.post(wire.Kind.DATA, SEQ, PART, target)
        theirs.sendall(stream)
        theirs.shutdown(socket.SHUT_WR)  # then the peer falls silent: EOF
        start = time.monotonic()
        try:
            connection.wait(request)
            error = None
        except TransportError as e:
            error = e
        finally:
            connection.close(timeout=0.5)
            theirs.close()
        # Not the peer timeout's 5 s: every stream ends in an answer at once.
        assert time.monotonic() - start < 2.5
        expected = _expected_outcome(stream)
        if expected is not None:
            assert error is None and target.tobytes() == expected
        else:
            assert error is not None and "worker:1" in str(error)
            assert isinstance(error, (ProtocolError, PeerLostError))

    check()


class _Recording(socket.socket):
    """A socket that keeps what it sends, as a stranger on the path could record it."""

    def __init__(self, sock: socket.socket):
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.settimeout(5)
        self.sent = []

    def sendall(self, data, *args):
        self.sent.append(bytes(data))
        return super().sendall(data, *args)


def _record_handshake(secret_of_acceptor: bytes):
    """A real handshake's bytes in each direction: (the connector's, the acceptor's)."""
    connector, acceptor = (_Recording(s) for s in socket.socketpair())
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, wire.accept_handshake, acceptor,
                                                    secret_of_acceptor, 0, {1: PEER}, PEER))
    thread.start()
    _catch(errors, wire.connect_handshake, connector, SECRET, 1, Peer(0, "worker:0"))
    connector.shutdown(socket.SHUT_RDWR)  # a refused connector hangs up
    thread.join(10)
    connector.close()
    acceptor.close()
    assert (secret_of_acceptor == SECRET) == (not errors), errors
    return b"".join(connector.sent), b"".join(acceptor.sent)


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except (TransportError, OSError) as e:
        errors.append(e)


RECORDED = {"this job": _record_handshake(SECRET), "another job": _record_handshake(b"x" * 32)}


def _mutated(draw, stream: bytes) -> bytes:
    stream = bytearray(stream)
    if stream and draw(st.booleans()):
        bit = draw(st.integers(0, len(stream) * 8 - 1))
        stream[bit // 8] ^= 1 << (bit % 8)
    return bytes(stream[:draw(st.integers(0, len(stream)))])


@st.composite
def _from_strangers(draw, recorded_side: int):
    """What a stranger sends a handshake: a replayed one (mutated or not), or anything."""
    choice = draw(st.sampled_from(["replay", "noise", "frames"]))
    if choice == "replay":
        return _mutated(draw, RECORDED[draw(st.sampled_from(list(RECORDED)))][recorded_side])
    if choice == "noise":
        return draw(st.binary(max_size=200))
    return _mutated(draw, b"".join(draw(st.lists(_frames, max_size=4))))


def _run_side(fn, stream: bytes):
    ours, theirs = socket.socketpair()
    ours.settimeout(2.0)
    theirs.sendall(stream)
    theirs.shutdown(socket.SHUT_WR)
    start = time.monotonic()
    try:
        fn(ours)
    except TransportError as e:
        return e, time.monotonic() - start
    finally:
        ours.close()
        theirs.close()
    raise AssertionError(f"a handshake with {stream!r} succeeded without the secret")


def test_a_stranger_never_passes_the_accepting_handshake():
    stranger = Peer(-1, "a connection from 198.18.0.9:5555")

    @FUZZ
    @given(_from_strangers(recorded_side=0))
    def check(stream):
        error, seconds = _run_side(
            lambda sock: wire.accept_handshake(sock, SECRET, 0, {1: PEER}, stranger), stream)
        assert isinstance(error, (AuthenticationError, ProtocolError, PeerLostError))
        assert str(stranger) in str(error) and seconds < 1.0

    check()


def test_a_stranger_never_passes_the_connecting_handshake():
    @FUZZ
    @given(_from_strangers(recorded_side=1))
    def check(stream):
        error, seconds = _run_side(
            lambda sock: wire.connect_handshake(sock, SECRET, 1, PEER), stream)
        assert isinstance(error, (AuthenticationError, ProtocolError, PeerLostError))
        assert str(PEER) in str(error) and seconds < 1.0

    check()
