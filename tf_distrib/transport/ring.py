"""All-reduce over the mesh's TCP connections: the ring, reduce-scatter then all-gather.

The flat buffer is cut into one chunk per worker. In N-1 steps each worker sends a
chunk to the next worker and adds the chunk the previous one sends it; then each chunk
travels once more round the ring, complete. Every worker sends and receives 2(N-1)/N of
the buffer, the least any all-reduce can, and each chunk is summed in one fixed order
and then copied, so every worker ends with the same bits.

Small buffers (Keras' logged values, every step) skip the ring: each worker sends its
buffer to every other and sums all of them in rank order, one round trip instead of
2(N-1) (one float between two simulated hosts: 0.29 ms, through the ring 0.40 ms).
Where the cost model says so (4 workers or more), `halving_doubling` runs instead:
2 log2(N) rounds for the ring's 2(N-1).
"""

from __future__ import annotations

import numpy as np

from tf_distrib.transport import halving_doubling, wire
from tf_distrib.transport.buffers import sum_into
from tf_distrib.transport.mesh import Mesh

# When a worker's copies to all peers total at most this, the buffer goes to every peer
# at once (the connection sends such frames from the calling thread).
EXCHANGE_BYTES = 64 << 10


def all_reduce(mesh: Mesh, seq: int, flat: np.ndarray, scratch) -> None:
    """Sums `flat` (1-D) across the mesh's workers, in place: by exchange, halving-doubling
    or the ring.

    Args:
        mesh: The connected workers.
        seq: The collective's number, the same on every worker.
        flat: This worker's values; the sum on return.
        scratch: `scratch(nbytes, dtype)` returns a buffer of at least nbytes.
    """
    n = len(mesh.peers)
    if n == 1:
        return
    if flat.nbytes * (n - 1) <= EXCHANGE_BYTES:
        _exchange_all_reduce(mesh, seq, flat)
    elif halving_doubling.preferred(n, flat.nbytes):
        halving_doubling.halving_doubling_all_reduce(
            mesh, seq, flat, lambda count: scratch(count * flat.itemsize, flat.dtype))
    else:
        _ring_all_reduce(mesh, seq, flat, scratch((len(flat) // n + 1) * flat.itemsize,
                                                  flat.dtype))


def _ring_all_reduce(mesh: Mesh, seq: int, flat: np.ndarray, scratch: np.ndarray) -> None:
    """The ring: `scratch` holds at least len(flat) // N + 1 elements."""
    n, rank = len(mesh.peers), mesh.rank
    bounds = [len(flat) * c // n for c in range(n + 1)]
    chunk = lambda c: flat[bounds[c % n]:bounds[c % n + 1]]  # noqa: E731
    send_to, recv_from = mesh.connections[(rank + 1) % n], mesh.connections[(rank - 1) % n]
    for step in range(n - 1):
        incoming = chunk(rank - step - 1)
        received = recv_from.post(wire.Kind.DATA, seq, step, scratch[:len(incoming)])
        sent = send_to.send(wire.Kind.DATA, seq, step, [chunk(rank - step)])
        recv_from.wait(received)
        sum_into(incoming, [incoming, scratch[:len(incoming)]])
        send_to.wait(sent)
    for step in range(n - 1):
        received = recv_from.post(wire.Kind.DATA, seq, n - 1 + step, chunk(rank - step))
        sent = send_to.send(wire.Kind.DATA, seq, n - 1 + step, [chunk(rank + 1 - step)])
        recv_from.wait(received)
        send_to.wait(sent)


def _exchange_all_reduce(mesh: Mesh, seq: int, flat: np.ndarray) -> None:
    """Sums `flat` in place: every worker sends it to every other, then sums in rank order."""
    parts = [flat.copy() if r == mesh.rank else np.empty_like(flat)
             for r in range(len(mesh.peers))]
    received = [(c, c.post(wire.Kind.DATA, seq, 0, parts[r]))
                for r, c in mesh.connections.items()]
    sent = [(c, c.send(wire.Kind.DATA, seq, 0, [flat])) for c in mesh.connections.values()]
    for connection, request in received + sent:
        connection.wait(request)
    sum_into(flat, parts)
