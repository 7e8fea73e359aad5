"""Same-host all-reduce through one shared-memory segment.

When every worker runs on one host, bytes need not cross the kernel's TCP stack:
each worker copies its part of a chunk into its own slot of a segment in /dev/shm,
tells the others, and sums every slot, in rank order, into its result. Slots come in
two generations (chunk k uses generation k % 2): a worker announces chunk k only after
it has summed chunk k-1, so nobody overwrites a slot that someone still reads.
Measured on 2 pinned cores: 7.4 MB of float32 in ~0.7 ms of CPU per worker, against
~4 ms over loopback TCP and ~14 ms for TensorFlow's collective.

Workers tell each other a chunk is written by raising a counter in the segment that the
others poll (x86-64), or with a READY frame on the mesh (elsewhere). A frame costs two
thread hand-offs per peer: ~0.17 ms for one float (Keras reduces every logged value at
every step), 0.3 ms of the 2.6 ms that a 7.4 MB all-reduce took between 2 pinned workers;
the counter costs a few microseconds. x86-64 keeps stores in order, so a counter seen
raised means the slot it covers is written; other architectures would need memory
fences that Python cannot issue.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import struct
import time

import numpy as np

from tf_distrib.transport import wire
from tf_distrib.transport.buffers import Layout, sum_into
from tf_distrib.transport.errors import ProtocolError
from tf_distrib.transport.mesh import Mesh

_MAGIC = b"tf_distrib shm 1"
_HEADER_BYTES = 4096
# In the header, one 64-byte line per rank (no false sharing): the number of chunks the
# rank has written, then the (bytes, dtype) it sums in each slot generation.
_COUNTERS_OFFSET, _LINE_BYTES = 1024, 64
MAX_POLLED_WORLD = (_HEADER_BYTES - _COUNTERS_OFFSET) // _LINE_BYTES
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
# Polling: spin, then yield the core, then sleep; a peer's liveness is checked this often.
_SPIN_SECONDS, _YIELD_SECONDS, _SLEEP_SECONDS, _CHECK_SECONDS = 2e-5, 2e-3, 1e-4, 0.05
# Each chunk costs one READY round (~0.1 ms): 16 MiB slots where there is room, but
# never more than a quarter of the free space (Docker's /dev/shm is 64 MB).
MAX_CHUNK_BYTES = 16 << 20
MIN_CHUNK_BYTES = 1 << 20


def chunk_bytes_for(world: int, directory: str = "/dev/shm") -> int:
    """The slot size a segment for `world` workers in `directory` should use."""
    stats = os.statvfs(directory)
    room = stats.f_bavail * stats.f_frsize // 4 // (2 * world)
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, room // MIN_CHUNK_BYTES * MIN_CHUNK_BYTES))


class SharedSegment:
    """A mapped /dev/shm segment: a header, then 2 generations x `world` slots.

    Create it on one worker (`create`), attach on the others (`attach`), then
    `unlink` its name once all are attached: the mapping outlives the name, and no
    file is left behind if a worker dies.
    """

    def __init__(self, path: str, mapping: mmap.mmap, world: int, chunk_bytes: int):
        self.path, self.world, self.chunk_bytes = path, world, chunk_bytes
        self._map = mapping

    @classmethod
    def create(cls, world: int, chunk_bytes: int,
               directory: str = "/dev/shm") -> tuple[SharedSegment, str]:
        """A new segment and the token that proves a worker attached the right one.

        Raises:
            OSError: e.g. /dev/shm is missing or too small (ENOSPC).
        """
        token = secrets.token_hex(16)
        path = os.path.join(directory, f"tf_distrib-{secrets.token_hex(8)}")
        size = _HEADER_BYTES + 2 * world * chunk_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve every page now: writing to a tmpfs page that does not fit
            # would kill the process with SIGBUS later.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mapping[:_HEADER_BYTES] = (_MAGIC + token.encode() + struct.pack("!Q", chunk_bytes)
                                   ).ljust(_HEADER_BYTES, b"\0")
        return cls(path, mapping, world, chunk_bytes), token

    @classmethod
    def attach(cls, path: str, token: str, world: int) -> SharedSegment:
        """Maps the segment another worker created; OSError if it is not that one."""
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        signature = _MAGIC + token.encode()
        (chunk_bytes,) = struct.unpack_from("!Q", mapping, len(signature))
        if (mapping[:len(signature)] != signature
                or len(mapping) != _HEADER_BYTES + 2 * world * chunk_bytes):
            mapping.close()
            raise OSError(f"{path} is not this job's segment")
        return cls(path, mapping, world, chunk_bytes)

    def unlink(self) -> None:
        """Removes the segment's name (the mappings stay valid)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def slot(self, generation: int, rank: int, dtype: np.dtype, count: int) -> np.ndarray:
        offset = _HEADER_BYTES + (generation * self.world + rank) * self.chunk_bytes
        return np.frombuffer(self._map, dtype, count, offset)

    def line(self, rank: int) -> np.ndarray:
        """Rank's control line: [chunks written, gen 0 bytes, gen 0 dtype, gen 1 ...]."""
        return np.frombuffer(self._map, np.int64, 5, _COUNTERS_OFFSET + rank * _LINE_BYTES)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # results TensorFlow still holds view it; the OS unmaps it at exit


class SharedMemoryReducer:
    """Sums (and gathers) flat layouts across the workers of one host through a `SharedSegment`.

    `mesh` is the host's workers: a `Mesh`, or a `SubMesh` of a larger one.
    """

    def __init__(self, mesh: Mesh, segment: SharedSegment):
        self.mesh, self.segment = mesh, segment
        self._chunks = 0  # chunks so far: chunk k uses slot generation k % 2
        self._polled = _ORDERED_STORES and segment.world <= MAX_POLLED_WORLD
        self._lines = ({r: segment.line(r) for r in range(segment.world)} if self._polled
                       else {})

    def all_reduce(self, seq: int, layout: Layout, arrays: list[np.ndarray],
                   out: np.ndarray) -> None:
        """out = the sum over workers of each worker's `arrays` in `layout`."""
        per_chunk = self.segment.chunk_bytes // layout.dtype.itemsize
        connections = list(self.mesh.connections.values())
        for part, start in enumerate(range(0, layout.size, per_chunk)):
            stop = min(layout.size, start + per_chunk)
            generation = self._chunks % 2
            self._chunks += 1
            slots = [self.segment.slot(generation, r, layout.dtype, stop - start)
                     for r in range(self.segment.world)]
            layout.gather(arrays, start, stop, slots[self.mesh.rank])
            if self._polled:
                self._announce_and_poll(seq, generation, layout)
            else:
                self._announce_and_wait(seq, part, layout, connections)
            sum_into(out[start:stop], slots)

    def all_gather(self, seq: int, layout: Layout, bounds: list[int], out: np.ndarray) -> None:
        """out[bounds[r]:bounds[r + 1]] = worker r's, for every worker r (of `out`'s length).

        Each worker writes only its own slice; every worker copies the others' (no sums).
        """
        rank, per_chunk = self.mesh.rank, self.segment.chunk_bytes // layout.dtype.itemsize
        connections = list(self.mesh.connections.values())
        # Frame parts of this collective's all-reduce count from 0; these from here.
        first_part = -(-layout.size // per_chunk)
        for part, start in enumerate(range(0, layout.size, per_chunk), first_part):
            stop = min(layout.size, start + per_chunk)
            generation = self._chunks % 2
            self._chunks += 1
            slots = [self.segment.slot(generation, r, layout.dtype, stop - start)
                     for r in range(self.segment.world)]
            parts = [(max(bounds[r], start), min(bounds[r + 1], stop))
                     for r in range(self.segment.world)]
            low, high = parts[rank]
            if low < high:
                slots[rank][low - start:high - start] = out[low:high]
            if self._polled:
                self._announce_and_poll(seq, generation, layout)
            else:
                self._announce_and_wait(seq, part, layout, connections)
            for r, (low, high) in enumerate(parts):
                if r != rank and low < high:
                    out[low:high] = slots[r][low - start:high - start]

    def _announce_and_wait(self, seq, part, layout, connections) -> None:
        # What each worker is about to sum: a mismatch (workers that run different
        # collectives) must fail, not sum unrelated slots.
        mine = struct.pack("!Q8s", layout.nbytes, layout.dtype.name.encode()[:8])
        theirs = [bytearray(len(mine)) for _ in connections]
        ready = [c.post(wire.Kind.READY, seq, part, t)
                 for c, t in zip(connections, theirs, strict=True)]
        told = [c.send(wire.Kind.READY, seq, part, [mine]) for c in connections]
        for connection, request, signature in zip(connections, ready, theirs, strict=True):
            connection.wait(request)
            if signature != mine:
                _mismatch(connection, seq, struct.unpack("!Q8s", signature), layout)
        for connection, request in zip(connections, told, strict=True):
            connection.wait(request)

    def _publish(self, layout) -> tuple[int, int]:
        """Writes this worker's signature for the current chunk, then its chunk count."""
        mine = (layout.nbytes, int.from_bytes(layout.dtype.name.encode()[:8], "little"))
        line, field = self._lines[self.mesh.rank], 1 + 2 * ((self._chunks - 1) % 2)
        line[field:field + 2] = mine
        line[0] = self._chunks  # after the slot and signature: x86-64 keeps this order
        return mine

    def _announce_and_poll(self, seq, generation, layout) -> None:
        mine = self._publish(layout)
        for rank, connection in self.mesh.connections.items():
            theirs = self._lines[rank]
            if theirs[0] < self._chunks:
                self._poll(theirs, connection)
            size, dtype = (int(v) for v in theirs[1 + 2 * generation:3 + 2 * generation])
            if (size, dtype) != mine:
                _mismatch(connection, seq, (size, dtype.to_bytes(8, "little").rstrip(b"\0")
                                            .decode("ascii", "replace")), layout)

    def _poll(self, line: np.ndarray, connection) -> None:
        """Returns once `line` counts this worker's chunks; raises if its peer is lost."""
        start = time.perf_counter()
        checked = start
        connection.waiting = True
        try:
            while line[0] < self._chunks:
                now = time.perf_counter()
                if now - checked > _CHECK_SECONDS:
                    connection.check_alive()
                    checked = now
                if now - start > _YIELD_SECONDS:
                    time.sleep(_SLEEP_SECONDS)
                elif now - start > _SPIN_SECONDS:
                    os.sched_yield()
        finally:
            connection.waiting = False


def _mismatch(connection, seq, theirs, layout) -> None:
    raise ProtocolError(
        f"{connection.peer} sums {theirs} as collective {seq} while this worker sums "
        f"{(layout.nbytes, layout.dtype.name)}: the workers run different models, bucket "
        "sizes or code.")
