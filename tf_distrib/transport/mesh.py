"""Rendezvous: every worker listens on its own address and connects to every other one.

Each worker binds a listening socket to its own TF_CONFIG host (never to every
interface) on a free port, publishes "host:port" in the store, reads its peers'
addresses, connects to the lower ranks and accepts the higher ones. Every connection
passes the mutual HMAC handshake of `wire`; a connection that fails it is refused
and logged, and the mesh keeps waiting for the real peer until its deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import threading
import time

from tf_distrib.transport import wire
from tf_distrib.transport.connection import Connection
from tf_distrib.transport.errors import AuthenticationError, Peer, TransportError
from tf_distrib.transport.store import Store

_log = logging.getLogger("tf_distrib")
_HANDSHAKE_SECONDS = 10.0


class TransportUnavailable(TransportError):
    """Some worker cannot run the transport here; every worker falls back together."""


class Mesh:
    """Authenticated connections from worker `rank` to every other worker.

    Args:
        rank: This worker's rank, 0 <= rank < len(tasks).
        tasks: Every worker's TF_CONFIG task name ("worker:0", ...), by rank.
        host: This worker's TF_CONFIG host: where it listens and what peers dial.
        store: The key-value store the workers rendezvous through.
        prefix: A key prefix unique to this mesh within the job.
        secret: The job's shared secret.
        timeout: Seconds to wait for every peer to publish and connect.
        peer_timeout: Seconds of silence after which a peer counts as lost.
        extra: More of this worker's facts to publish (JSON-able), read back as `infos`.
            Defaults to None.
        link: Makes a link of an authenticated socket: `link(sock, peer, peer_timeout)`.
            Defaults to `Connection`.

    Attributes:
        peers: Every worker as a `Peer`, by rank (this one included).
        connections: rank -> its link (a `Connection`), for every other worker.
        infos: What each worker published, by rank.

    Raises:
        TransportUnavailable: some worker could not listen (every worker raises it,
            so that all fall back to TensorFlow's collective together).
        TransportError: a peer did not connect in time, or failed authentication.
    """

    def __init__(self, rank: int, tasks: list[str], host: str, store: Store, prefix: str,
                 secret: bytes, *, timeout: float, peer_timeout: float, extra: dict | None = None,
                 link=Connection):
        self.rank = rank
        self._link = link
        deadline = time.monotonic() + timeout
        listener, published = None, {"task": tasks[rank], **(extra or {})}
        try:
            listener = _listen(host)
            published["address"] = f"{_url_host(host)}:{listener.getsockname()[1]}"
        except OSError as e:
            published["error"] = (f"{tasks[rank]} cannot listen on its TF_CONFIG host {host!r} "
                                  f"({e.strerror or e})")
        store.set(f"{prefix}/{rank}", json.dumps(published))
        self.infos = []
        for r, task in enumerate(tasks):
            try:
                self.infos.append(json.loads(store.get(f"{prefix}/{r}", _left(deadline))))
            except TimeoutError:
                if listener is not None:
                    listener.close()
                raise TransportError(
                    f"{tasks[rank]}: {task} did not join the transport's rendezvous within "
                    f"{timeout:g} s (stopped, restarted or stuck before it); the hang "
                    "timeout bounds this wait.") from None
        problems = [info["error"] for info in self.infos if "error" in info]
        if problems:
            if listener is not None:
                listener.close()
            raise TransportUnavailable("; ".join(problems))
        self.peers = [Peer(r, tasks[r], info["address"]) for r, info in enumerate(self.infos)]
        self.connections: dict[int, Connection] = {}
        accepting = {r: self.peers[r] for r in range(rank + 1, len(tasks))}
        acceptor = threading.Thread(target=self._accept, name="tf_distrib-accept", daemon=True,
                                    args=(listener, secret, accepting, deadline, peer_timeout))
        acceptor.start()
        try:
            for r in range(rank):
                self.connections[r] = link(
                    _dial(self.peers[r], secret, rank, deadline), self.peers[r], peer_timeout)
            acceptor.join(_left(deadline) + 1)
        finally:
            listener.close()
        missing = [str(p) for r, p in accepting.items() if r not in self.connections]
        if missing:
            self.close()
            raise TransportError(
                f"{tasks[rank]}: no authenticated connection from {', '.join(missing)} within "
                f"{timeout:g} s. Check that every worker runs the same tf_distrib with the same "
                "TF_DISTRIB_SECRET and that the transport's ports are reachable between hosts, "
                "or use make_strategy(transport='tf').")

    def _accept(self, listener, secret, accepting, deadline, peer_timeout) -> None:
        listener.settimeout(0.2)
        lock = threading.Lock()

        def handshake(sock, address):
            stranger = Peer(-1, f"a connection from {address[0]}:{address[1]}")
            try:
                sock.settimeout(_HANDSHAKE_SECONDS)
                peer = wire.accept_handshake(sock, secret, self.rank, accepting, stranger)
                with lock:
                    if peer.rank in self.connections:
                        raise AuthenticationError(f"{peer} connected twice.")
                    self.connections[peer.rank] = self._link(sock, peer, peer_timeout)
            except (TransportError, OSError) as e:
                _log.warning("tf_distrib transport: refused a connection: %s", e)
                sock.close()

        threads = []
        while time.monotonic() < deadline and len(self.connections) < self.rank + len(accepting):
            with contextlib.suppress(TimeoutError):
                sock, address = listener.accept()
                threads.append(threading.Thread(target=handshake, args=(sock, address),
                                                daemon=True))
                threads[-1].start()
            with lock:
                done = all(r in self.connections for r in accepting)
            if done:
                break
        for thread in threads:
            thread.join(_HANDSHAKE_SECONDS)

    def close(self) -> None:
        """Closes every connection, each after a goodbye."""
        for connection in self.connections.values():
            connection.close()
        self.connections.clear()


@dataclasses.dataclass
class SubMesh:
    """Some workers of a `Mesh`, renumbered 0, 1, ... in `ranks` order, on its connections.

    The all-reduce algorithms take one in place of a `Mesh`: the hierarchical
    all-reduce runs shared memory on the workers of a host and a ring on the workers
    of the same local index across hosts.

    Attributes:
        rank: This worker's rank within the sub-mesh.
        peers: Its workers, by sub-mesh rank.
        connections: Sub-mesh rank -> `Connection`, for every other worker in it.
    """

    rank: int
    peers: list[Peer]
    connections: dict[int, Connection]

    @classmethod
    def of(cls, mesh: Mesh, ranks: list[int]) -> SubMesh:
        """The workers of `mesh` whose ranks are `ranks` (this worker among them)."""
        return cls(ranks.index(mesh.rank), [mesh.peers[r] for r in ranks],
                   {i: mesh.connections[r] for i, r in enumerate(ranks) if r != mesh.rank})


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _listen(host: str) -> socket.socket:
    """A listening socket on `host` (its first address) and a free port."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.bind(address[:2] if family == socket.AF_INET else address)
        listener.listen(64)
    except OSError:
        listener.close()
        raise
    return listener


def _dial(peer: Peer, secret: bytes, rank: int, deadline: float) -> socket.socket:
    host, _, port = peer.address.rpartition(":")
    while True:
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)),
                                            timeout=min(_HANDSHAKE_SECONDS, _left(deadline) + 1))
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TransportError(f"cannot connect to {peer}: {e.strerror or e}. Check that "
                                     "the transport's ports are reachable between hosts.") from e
            time.sleep(0.1)
            continue
        try:
            wire.connect_handshake(sock, secret, rank, peer)
        except BaseException:
            sock.close()
            raise
        return sock
