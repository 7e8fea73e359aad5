"""The TCP transport's small all-reduces as a TensorFlow op (`native_exchange.cc`).

On the Python path a small all-reduce across hosts (PowerSGD's P and Q factors, Keras'
logged loss: three per step) costs a worker ~0.4 ms of CPU and ~1 ms of wall time, most
of it in hand-offs between TensorFlow's thread, the transport's and the connections'.
The op runs the same exchange as `ring`'s (each worker sends its tensors to every other
and sums all of them in rank order) in the thread TensorFlow runs it in, on sockets of
its own: one per pair of workers, connected and authenticated by a second `Mesh` of the
transport's workers (the same rendezvous, secret and handshake). It takes what the
Python path would exchange (`ring.EXCHANGE_BYTES`); the rest keeps the Python path. Its
control block and watcher (`native_control`) stop it, naming the peer, as the transport
would: a lost peer's connection fails the transport, a silent one's heartbeats stop.

Example: `sums = transport.exchange.all_reduce(ticket, [p_factor, loss])`.
"""

from __future__ import annotations

import contextlib
import socket

import numpy as np

from tf_distrib.transport import native_control, ring, shared_memory
from tf_distrib.transport.mesh import Mesh


def plain_socket(sock, peer, peer_timeout):
    """A `Mesh` link that stays the authenticated socket itself (the op's)."""
    return sock


class NativeExchange(native_control.ControlBlock):
    """The op bound to a transport's workers through sockets of its own.

    Args:
        transport: The "tcp" `Transport` whose small all-reduces it runs.
        lanes: A `Mesh` of the same workers whose links are plain sockets (`link=
            plain_socket`); the op owns them, and keeps them open until the process exits.
        op_library: `native_sum.library()`.
    """

    DTYPES = ("float32", "int64")

    def __init__(self, transport, lanes: Mesh, op_library):
        self._sockets = lanes.connections
        for sock in self._sockets.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().__init__(transport, kept=tuple(self._sockets.values()))
        self._library = op_library
        world = transport.world
        self._attrs = dict(
            fds=[self._sockets[r].fileno() if r in self._sockets else -1 for r in range(world)],
            peers=["" if r == transport.rank else str(transport.mesh.peers[r])
                   for r in range(world)],
            control=self.address, rank=transport.rank)

    def takes(self, tensors) -> bool:
        """Whether the op sums `tensors` (traced tensors, of one dtype): shapes known,
        a dtype of `DTYPES`, and few enough bytes to send to every peer."""
        dtype = tensors[0].dtype
        if dtype.name not in self.DTYPES or not all(t.shape.is_fully_defined()
                                                    for t in tensors):
            return False
        nbytes = sum(t.shape.num_elements() for t in tensors) * dtype.size
        return nbytes * (self.transport.world - 1) <= ring.EXCHANGE_BYTES

    def all_reduce(self, ticket, tensors):
        """The sums over workers of `tensors` (`takes` them), after the op that made
        `ticket`."""
        code = shared_memory.dtype_code(np.dtype(tensors[0].dtype.as_numpy_dtype))
        return self._library.tf_distrib_exchange_sum(ticket, tensors, dtype_code=code,
                                                     name="tf_distrib_all_reduce",
                                                     **self._attrs)

    def close(self) -> None:
        """Fails the op from now on and ends the sockets (their descriptors stay taken:
        a traced op holds their numbers)."""
        super().close()
        for sock in self._sockets.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

