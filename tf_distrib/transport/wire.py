"""The transport's wire format: fixed frame headers and a mutual HMAC handshake.

A frame is a 24-byte header, then `length` bytes of payload:

    magic "TFDT" | version u8 | kind u8 | part u16 | seq u64 | length u64   (network order)

A receiver accepts only the frame it expects (`seq` the collective, `part` the chunk), so
a malformed frame raises `ProtocolError`. Handshake (connecting C, accepting A, secret S):

    C -> A  HELLO      rank_C, nonce_C
    A -> C  CHALLENGE  nonce_A, HMAC(S, "acceptor" | ranks | nonce_C | nonce_A)
    C -> A  PROOF      HMAC(S, "connector" | ranks | nonce_A | nonce_C)
    A -> C  WELCOME

Fresh nonces make a recorded handshake useless. Authenticated, not encrypted.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import socket
import struct

from tf_distrib.transport.errors import AuthenticationError, Peer, PeerLostError, ProtocolError

MAGIC = b"TFDT"
VERSION = 1
HEADER = struct.Struct("!4sBBHQQ")
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
# Frames other than DATA carry at most this much (an ABORT's message).
MAX_CONTROL_PAYLOAD = 4096


class Kind(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    WELCOME = 4
    DATA = 5
    READY = 6
    HEARTBEAT = 7
    ABORT = 8
    BYE = 9


# Frames that carry nothing: a length (or numbers) there would desynchronize the stream.
_EMPTY = frozenset({Kind.WELCOME, Kind.HEARTBEAT, Kind.BYE})
_HANDSHAKE_PAYLOAD = {Kind.HELLO: 4 + NONCE_BYTES, Kind.CHALLENGE: NONCE_BYTES + MAC_BYTES,
                      Kind.PROOF: MAC_BYTES, Kind.WELCOME: 0}


def header(kind: Kind, seq: int = 0, part: int = 0, length: int = 0) -> bytes:
    """The header of a frame."""
    return HEADER.pack(MAGIC, VERSION, kind, part, seq, length)


def parse_header(raw: bytes, peer: Peer) -> tuple[Kind, int, int, int]:
    """(kind, seq, part, length) of a header from `peer`; ProtocolError if malformed."""
    magic, version, kind, part, seq, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"{peer} sent a frame that is not tf_distrib's (magic {magic!r}); "
                            "is another program connected to the transport's port?")
    if version != VERSION:
        raise ProtocolError(f"{peer} speaks transport version {version}, this worker {VERSION}: "
                            "install the same tf_distrib version on every worker.")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"{peer} sent a frame of unknown kind {kind}.") from None
    if kind in _EMPTY and (length or seq or part):
        raise ProtocolError(f"{peer} sent a {kind.name} frame with numbers or a payload "
                            f"({seq}/{part}, {length} bytes); such frames have none.")
    if kind != Kind.DATA and length > MAX_CONTROL_PAYLOAD:
        raise ProtocolError(f"{peer} sent a {kind.name} frame of {length} bytes, more than "
                            f"the {MAX_CONTROL_PAYLOAD} such frames may have.")
    return kind, seq, part, length


def recv_into_exactly(sock: socket.socket, view: memoryview, peer: Peer) -> None:
    """Fills `view` from `sock`; PeerLostError if the peer closes first (a truncated frame)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerLostError(f"{peer} closed the connection in the middle of a frame "
                                f"({got} of {len(view)} bytes arrived).", peer)
        got += n


def recv_exactly(sock: socket.socket, n: int, peer: Peer) -> bytes:
    buffer = bytearray(n)
    recv_into_exactly(sock, memoryview(buffer), peer)
    return bytes(buffer)


def recv_frame(sock: socket.socket, expected: Kind, peer: Peer) -> bytes:
    """Reads one handshake frame of kind `expected` and returns its payload."""
    kind, _, _, length = parse_header(recv_exactly(sock, HEADER.size, peer), peer)
    if kind != expected or length != _HANDSHAKE_PAYLOAD[expected]:
        raise ProtocolError(f"{peer} sent {kind.name} ({length} bytes) during the handshake, "
                            f"expected {expected.name}.")
    return recv_exactly(sock, length, peer)


def _mac(secret: bytes, role: bytes, connector: int, acceptor: int, *nonces: bytes) -> bytes:
    message = role + struct.pack("!II", connector, acceptor) + b"".join(nonces)
    return hmac.new(secret, message, hashlib.sha256).digest()


def connect_handshake(sock: socket.socket, secret: bytes, rank: int, peer: Peer) -> None:
    """The connecting side of the handshake; returns once `peer` has welcomed us.

    Raises:
        AuthenticationError: `peer` could not prove the secret, or refused ours.
    """
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(header(Kind.HELLO, length=4 + NONCE_BYTES) + struct.pack("!I", rank) + nonce)
    try:
        challenge = recv_frame(sock, Kind.CHALLENGE, peer)
    except PeerLostError:
        raise AuthenticationError(
            f"{peer} refused this worker's connection: the workers were given different "
            "secrets (TF_DISTRIB_SECRET must be the same on every worker).") from None
    their_nonce, their_mac = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    if not hmac.compare_digest(their_mac, _mac(secret, b"acceptor", rank, peer.rank, nonce,
                                               their_nonce)):
        raise AuthenticationError(
            f"{peer} could not prove that it knows the job's secret: another program "
            "listens at its address, or TF_DISTRIB_SECRET differs between workers.")
    sock.sendall(header(Kind.PROOF, length=MAC_BYTES)
                 + _mac(secret, b"connector", rank, peer.rank, their_nonce, nonce))
    try:
        recv_frame(sock, Kind.WELCOME, peer)
    except PeerLostError:
        raise AuthenticationError(f"{peer} refused this worker's proof of the secret "
                                  "(TF_DISTRIB_SECRET differs between workers).") from None


def accept_handshake(sock: socket.socket, secret: bytes, rank: int,
                     expected: dict[int, Peer], stranger: Peer) -> Peer:
    """The accepting side: returns the authenticated peer among `expected` (rank -> Peer).

    Raises:
        AuthenticationError or ProtocolError: the connection is to be refused; the
            message says why (it names `stranger`, the connection's address).
    """
    hello = recv_frame(sock, Kind.HELLO, stranger)
    (their_rank,), their_nonce = struct.unpack("!I", hello[:4]), hello[4:]
    if their_rank not in expected:
        raise AuthenticationError(f"{stranger} claims rank {their_rank}, which this worker "
                                  f"does not expect (expected {sorted(expected)}).")
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(header(Kind.CHALLENGE, length=NONCE_BYTES + MAC_BYTES) + nonce
                 + _mac(secret, b"acceptor", their_rank, rank, their_nonce, nonce))
    proof = recv_frame(sock, Kind.PROOF, stranger)
    if not hmac.compare_digest(proof, _mac(secret, b"connector", their_rank, rank, nonce,
                                           their_nonce)):
        raise AuthenticationError(f"{stranger} does not know the job's secret (claimed to be "
                                  f"rank {their_rank}).")
    sock.sendall(header(Kind.WELCOME))
    return expected[their_rank]
