"""Recursive halving-doubling all-reduce over the mesh's TCP connections (Rabenseifner).

A ring takes 2(N-1) rounds of messages; at 512 workers their latency alone costs
~0.2 s per all-reduce, whatever the link. Halving-doubling takes 2 log2(N): in the
reduce-scatter each worker swaps half of what it still sums with the worker whose rank
differs in one bit and adds the half it keeps, log2(N) times, until it holds its own
N-th of the sum; the all-gather runs the same pairs backwards, doubling what each
holds. The first, largest swaps go to the nearest ranks (rank ^ 1, then ^ 2, ...),
which the launcher puts on the same host. With N a power of two every worker sends
2(N-1)/N of the buffer, as in the ring. Otherwise the ranks from P (the largest power
of two below N) on first hand their buffer to rank - P and get the sum back at the
end: 2 more rounds and 2 buffers more on those pairs' links. Each element's sum is
made on one worker and copied to the others: every worker ends with the same bits.
`preferred` says where it beats the ring: many workers, or small buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tf_distrib.transport import wire
from tf_distrib.transport.buffers import sum_into
from tf_distrib.transport.mesh import Mesh

#: The cost model's assumptions for the choice: a round of messages (measured between
#: two simulated hosts: 0.2 ms) and a byte over the link (10 Gbit/s).
ROUND_SECONDS, BYTE_SECONDS = 2e-4, 0.8e-9
#: Its bytes cost this much more than the ring's: on 4 simulated hosts at 1 Gbit/s it
#: measured 2-11% slower than the ring for the same bytes (its messages are 2x longer
#: at the first step, and a link shaper's burst helps them less).
BYTES_PENALTY = 1.1


def preferred(workers: int, nbytes: int) -> bool:
    """Whether halving-doubling beats the ring for `nbytes` over `workers` by the cost
    model (rounds x ROUND_SECONDS + bytes on the busiest link x BYTE_SECONDS)."""
    if workers < 4:  # 2: the same exchange; 3: as many rounds as the ring
        return False
    power = 1 << (workers.bit_length() - 1)
    ring = 2 * (workers - 1) * ROUND_SECONDS + 2 * (workers - 1) / workers * nbytes * BYTE_SECONDS
    folded = 0 if power == workers else 2
    halving = ((2 * power.bit_length() - 2 + folded) * ROUND_SECONDS
               + (2 * (power - 1) / power + folded) * nbytes * BYTE_SECONDS * BYTES_PENALTY)
    return halving < ring


def halving_doubling_all_reduce(mesh: Mesh, seq: int, flat: np.ndarray,
                                scratch: Callable[[int], np.ndarray]) -> None:
    """Sums `flat` (1-D) across the mesh's workers, in place.

    Args:
        mesh: The connected workers.
        seq: The collective's number, the same on every worker.
        flat: This worker's values; the sum on return.
        scratch: Returns a buffer of at least the given number of flat's elements.
    """
    n, rank = len(mesh.peers), mesh.rank
    power = 1 << (n.bit_length() - 1)
    steps = power.bit_length() - 1
    if rank >= power:  # folded into rank - power: it sums for this one
        partner = mesh.connections[rank - power]
        partner.wait(partner.send(wire.Kind.DATA, seq, 0, [flat]))
        partner.wait(partner.post(wire.Kind.DATA, seq, 2 * steps + 1, flat))
        return
    buffer = scratch(len(flat) if rank + power < n else len(flat) // 2 + 1)
    if rank + power < n:
        extra, received = mesh.connections[rank + power], buffer[:len(flat)]
        extra.wait(extra.post(wire.Kind.DATA, seq, 0, received))
        sum_into(flat, [flat, received])
    bounds = [len(flat) * c // power for c in range(power + 1)]
    # The chunks this worker still sums, then holds: at the swap with rank ^ 2^k, the
    # half of them that bit k of its rank says (partners hold the same chunks then).
    low, high = 0, power
    for step in range(steps):
        distance, middle = 1 << step, (low + high) // 2
        keep, give = ((low, middle), (middle, high)) if not rank & distance else (
            (middle, high), (low, middle))
        _swap(mesh.connections[rank ^ distance], seq, 1 + step, flat, bounds, keep, give,
              buffer)
        low, high = keep
    for step in reversed(range(steps)):
        distance, size = 1 << step, high - low
        theirs = (high, high + size) if not rank & distance else (low - size, low)
        connection = mesh.connections[rank ^ distance]
        received = connection.post(wire.Kind.DATA, seq, 2 * steps - step,
                                   flat[bounds[theirs[0]]:bounds[theirs[1]]])
        sent = connection.send(wire.Kind.DATA, seq, 2 * steps - step,
                               [flat[bounds[low]:bounds[high]]])
        connection.wait(received)
        connection.wait(sent)
        low, high = min(low, theirs[0]), max(high, theirs[1])
    if rank + power < n:
        extra.wait(extra.send(wire.Kind.DATA, seq, 2 * steps + 1, [flat]))


def _swap(connection, seq: int, part: int, flat: np.ndarray, bounds: list[int],
          keep: tuple[int, int], give: tuple[int, int], buffer: np.ndarray) -> None:
    """Sends the chunks `give` to the partner and adds its copy of the chunks `keep` (each
    chunk is summed on the one worker that keeps it, then copied: the same bits everywhere)."""
    kept = flat[bounds[keep[0]]:bounds[keep[1]]]
    incoming = buffer[:len(kept)]
    received = connection.post(wire.Kind.DATA, seq, part, incoming)
    sent = connection.send(wire.Kind.DATA, seq, part, [flat[bounds[give[0]]:bounds[give[1]]]])
    connection.wait(received)
    sum_into(kept, [kept, incoming])
    connection.wait(sent)
