"""Same-host all-reduce through one shared-memory segment.

When every worker runs on one host, bytes need not cross the kernel's TCP stack:
each worker copies its part of a chunk into its own slot of a segment in /dev/shm,
tells the others (a READY frame on the mesh), and sums every slot, in rank order, into
its result. Slots come in two generations (chunk k uses generation k % 2): a worker
announces chunk k only after it has summed chunk k-1, so nobody overwrites a slot
that someone still reads. Measured on 2 pinned cores: 7.4 MB of float32 in ~0.7 ms of
CPU per worker, against ~4 ms over loopback TCP and ~14 ms for TensorFlow's collective.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct

import numpy as np

from tf_distrib.transport import wire
from tf_distrib.transport.buffers import Layout, sum_into
from tf_distrib.transport.errors import ProtocolError
from tf_distrib.transport.mesh import Mesh

_MAGIC = b"tf_distrib shm 1"
_HEADER_BYTES = 4096
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

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # results TensorFlow still holds view it; the OS unmaps it at exit


class SharedMemoryReducer:
    """Sums flat layouts across the workers of one host through a `SharedSegment`."""

    def __init__(self, mesh: Mesh, segment: SharedSegment):
        self.mesh, self.segment = mesh, segment
        self._chunks = 0  # chunks so far: chunk k uses slot generation k % 2

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
                    raise ProtocolError(
                        f"{connection.peer} sums {struct.unpack('!Q8s', signature)} as "
                        f"collective {seq} while this worker sums "
                        f"{(layout.nbytes, layout.dtype.name)}: the workers run different "
                        "models, bucket sizes or code.")
            sum_into(out[start:stop], slots)
            for connection, request in zip(connections, told, strict=True):
                connection.wait(request)
