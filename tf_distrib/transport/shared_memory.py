"""Same-host all-reduce through one shared-memory segment.

Each worker copies its part of a chunk into its own slot of a segment in /dev/shm, tells
the others by raising a counter they poll (x86-64 keeps stores in order; elsewhere a
READY frame on the mesh), and sums every slot in rank order. Slots come in two
generations, so nobody overwrites a slot someone still reads. A bucket is
reduce-scattered in place: each worker sums its own 1/N of each chunk into the segment's
result regions and everyone's results are read-only views of them, so nobody copies a
sum back. A region is reused only when no worker still holds a view of it; otherwise
workers sum into private buffers. Across hosts ("shm+tcp") each worker ring-reduces its
part with its peers of the same local rank first. TensorFlow never writes into a result
it was handed (it reuses only buffers it allocated), so no worker changes what another
reads. docs/transport.md has the measured costs.
"""

from __future__ import annotations

import functools
import mmap
import os
import platform
import secrets
import struct
import sys
import time

import numpy as np

from tf_distrib.transport import ring, wire
from tf_distrib.transport.buffers import ALIGN, Layout, sum_into
from tf_distrib.transport.errors import ProtocolError
from tf_distrib.transport.mesh import Mesh

_MAGIC = b"tf_distrib shm 3"  # 2: result regions after the slots; 3: update regions
SEGMENT_PREFIX = "tf_distrib-"  # the segments' file names in /dev/shm
HEADER_BYTES = 4096
# In the header, one 64-byte line per rank (no false sharing): the number of chunks the
# rank has written, the (bytes, dtype) it sums in each slot generation, the number of
# chunks it has summed its part of, the result regions it still holds (a bit mask), and
# the update regions the native op's SGD step can write (a bit mask, `native_sum`).
# native_sum.cc reads and writes them too (the offsets reach it from native_sum.py).
COUNTERS_OFFSET, LINE_BYTES = 1024, 64
WRITTEN, SUMMED, _HELD, OFFERED = 0, 5, 6, 7
# Result regions of one slot each: results of 4 buckets at a time stay in shared memory.
RESULT_REGIONS = 4
# Then the native op's two update regions (`native_sum`), of this many slots each: the
# weights (and velocities) that every worker's variables hold.
UPDATE_REGION_SLOTS = 2
# Smaller buckets are summed in full by every worker: Keras keeps the logged values (at
# most 64 elements each) across steps, which would hold a region.
MIN_IN_PLACE_BYTES = 4096
MAX_POLLED_WORLD = (HEADER_BYTES - COUNTERS_OFFSET) // LINE_BYTES
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
# Polling: spin, then yield the core, then sleep; a peer's liveness is checked this often.
_SPIN_SECONDS, _YIELD_SECONDS, _SLEEP_SECONDS, CHECK_SECONDS = 2e-5, 2e-3, 1e-4, 0.05
# Each chunk costs one READY round (~0.1 ms): 16 MiB slots where there is room, but
# never more than a quarter of the free space (Docker's /dev/shm is 64 MB).
MAX_CHUNK_BYTES = 16 << 20
MIN_CHUNK_BYTES = 1 << 20


def chunk_bytes_for(world: int, directory: str = "/dev/shm") -> int:
    """The slot size a segment for `world` workers in `directory` should use."""
    stats = os.statvfs(directory)
    room = stats.f_bavail * stats.f_frsize // 4 // _slots(world)
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, room // MIN_CHUNK_BYTES * MIN_CHUNK_BYTES))


def _slots(world: int) -> int:
    """Slots of a segment: 2 generations x `world` inputs, the result regions, then the
    update regions."""
    return 2 * world + RESULT_REGIONS + 2 * UPDATE_REGION_SLOTS


class SharedSegment:
    """A mapped /dev/shm segment: a header, 2 generations x `world` slots, result regions,
    update regions.

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
        path = os.path.join(directory, f"{SEGMENT_PREFIX}{secrets.token_hex(8)}")
        size = HEADER_BYTES + _slots(world) * chunk_bytes
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
        mapping[:HEADER_BYTES] = (_MAGIC + token.encode() + struct.pack("!Q", chunk_bytes)
                                   ).ljust(HEADER_BYTES, b"\0")
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
                or len(mapping) != HEADER_BYTES + _slots(world) * chunk_bytes):
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
        offset = HEADER_BYTES + (generation * self.world + rank) * self.chunk_bytes
        return np.frombuffer(self._map, dtype, count, offset)

    def regions(self, first: int, count: int) -> np.ndarray:
        """Result regions `first` to `first + count - 1` as bytes, consecutive in the segment."""
        offset = HEADER_BYTES + (2 * self.world + first) * self.chunk_bytes
        return np.frombuffer(self._map, np.uint8, count * self.chunk_bytes, offset)

    def update_regions(self) -> tuple[int, int]:
        """The first update region's offset in the segment, and each one's bytes."""
        regions = HEADER_BYTES + (2 * self.world + RESULT_REGIONS) * self.chunk_bytes
        return regions, UPDATE_REGION_SLOTS * self.chunk_bytes

    def array(self) -> np.ndarray:
        """The whole segment as bytes; while it exists, `close` leaves the mapping in place."""
        return np.frombuffer(self._map, np.uint8)

    def line(self, rank: int) -> np.ndarray:
        """Rank's control line: [chunks written, gen 0 bytes, gen 0 dtype, gen 1 bytes,
        gen 1 dtype, chunks summed, regions held] (the native op's word follows)."""
        return np.frombuffer(self._map, np.int64, 7, COUNTERS_OFFSET + rank * LINE_BYTES)

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
        self.waited = 0.0  # seconds spent polling for peers' chunks
        self._polled = _ORDERED_STORES and segment.world <= MAX_POLLED_WORLD
        self._lines = ({r: segment.line(r) for r in range(segment.world)} if self._polled
                       else {})
        # Runs of consecutive result regions by (first, count), one array each, made when
        # first used: every view of a sum refers to its run's array, which is how `_held`
        # sees that TensorFlow still holds it.
        self._runs: dict[tuple[int, int], np.ndarray] = {}
        self._in_place = 0  # result regions taken so far: the next run starts after them

    @property
    def in_place_bytes(self) -> int | None:
        """One slot: the largest layout whose sum stays in shared memory with room for
        `RESULT_REGIONS` of them at a time, or None (a layout of up to `RESULT_REGIONS`
        slots takes as many regions)."""
        return self.segment.chunk_bytes if self._polled else None

    def fits_in_place(self, layout: Layout) -> bool:
        """Whether `all_reduce_scattered` can leave `layout`'s sum in shared memory."""
        return (self.in_place_bytes is not None
                and MIN_IN_PLACE_BYTES <= layout.nbytes <= RESULT_REGIONS * self.in_place_bytes)

    def all_reduce_scattered(self, seq: int, layout: Layout, arrays: list[np.ndarray],
                             private, across: Mesh | None = None,
                             scratch=None) -> tuple[np.ndarray, bool]:
        """The sum over workers of `arrays`, flat, by reduce-scatter: each slot-sized chunk
        is cut into one part per worker, and each worker sums its part.

        A layout that `fits_in_place` takes one result region per slot of its size, the
        next ones in turn, and its sum stays there unless a worker still holds one of
        them; otherwise every worker gathers the parts into a buffer from
        `private(nbytes, dtype)`. Needs polled counters (`in_place_bytes` is not None).

        Args:
            across: The workers of this worker's local rank on the other hosts ("shm+tcp",
                whose hosts use slots of one size): each part summed here is then
                ring-all-reduced with theirs. Defaults to None: one host.
            scratch: `scratch(nbytes, dtype)`, a buffer for that ring. Defaults to None.

        Returns:
            (sum, True): the sum is a read-only view of result regions; (sum, False): it
            is a buffer from `private`.
        """
        rank, chunk_bytes = self.mesh.rank, self.segment.chunk_bytes
        count = -(-layout.nbytes // chunk_bytes) if self.fits_in_place(layout) else 0
        first = self._in_place % RESULT_REGIONS
        if first + count > RESULT_REGIONS:  # a run does not wrap around the segment's end
            first = 0
        self._in_place = first + count
        taken, held = ((1 << count) - 1) << first, self._held()
        per_chunk = chunk_bytes // layout.dtype.itemsize
        out = in_place = None
        for start in range(0, layout.size, per_chunk):
            stop = min(layout.size, start + per_chunk)
            bounds, slots = self._scatter(seq, layout, arrays, start, stop, held)
            if out is None:
                # Every worker decides alike: each one's published mask is part of its chunk.
                in_place = count > 0 and not any(int(line[_HELD]) & taken
                                                 for line in self._lines.values())
                out = (self._run(first, count)[:layout.nbytes].view(layout.dtype) if in_place
                       else private(layout.nbytes, layout.dtype))
            low, high = bounds[rank], bounds[rank + 1]
            target = out[start:stop] if in_place else slots[rank]
            self._sum_part(layout, arrays, slots, start, low, high, target)
            if across is not None and low < high:
                # Frames on a connection are matched in order: each chunk's ring can
                # number its steps as the first one did.
                ring.all_reduce(across, seq, target[low:high], scratch)
            self._lines[rank][SUMMED] = self._chunks
            for r, connection in self.mesh.connections.items():
                if self._lines[r][SUMMED] < self._chunks:
                    self._poll(self._lines[r], connection, SUMMED)
            if not in_place:
                for r, slot in enumerate(slots):
                    out[start + bounds[r]:start + bounds[r + 1]] = slot[bounds[r]:bounds[r + 1]]
        if in_place:
            out.flags.writeable = False  # every worker reads it: a write would corrupt theirs
        return out, in_place

    def _scatter(self, seq: int, layout: Layout, arrays: list[np.ndarray], start: int,
                 stop: int, held: int) -> tuple[list[int], list[np.ndarray]]:
        """Writes into this worker's slot the elements [start, stop) of the layout (a
        chunk) that the others sum, and waits until every worker has.

        Returns:
            Each worker's part of the chunk, worker r's [bounds[r], bounds[r + 1]) from
            `start`, and the chunk's slots.
        """
        world, rank, size = self.segment.world, self.mesh.rank, stop - start
        # Parts start on 64-byte lines: two workers never write to one cache line.
        step = max(1, ALIGN // layout.dtype.itemsize)
        bounds = [min(size, -(-size * r // world // step) * step) for r in range(world + 1)]
        low, high = bounds[rank], bounds[rank + 1]
        generation = self._next_generation()
        slots = [self.segment.slot(generation, r, layout.dtype, size) for r in range(world)]
        layout.gather(arrays, start, start + low, slots[rank][:low])
        layout.gather(arrays, start + high, stop, slots[rank][high:])
        self._announce_and_poll(seq, generation, layout, held)
        return bounds, slots

    def _next_generation(self) -> int:
        """Counts a chunk and returns its slot generation. Polled, the count is read back
        from this worker's line: the native op (`native_sum`) counts its chunks there too.
        """
        if self._polled:
            self._chunks = int(self._lines[self.mesh.rank][WRITTEN])
        generation = self._chunks % 2
        self._chunks += 1
        return generation

    def _sum_part(self, layout, arrays, slots, start, low, high, result) -> None:
        """result[low:high] = the sum over workers, in rank order, of that part of the
        chunk that starts at element `start` of the layout.

        This worker's own addend comes from `arrays` (it never wrote it to its slot).
        """
        for lo, hi, piece in layout.segments(arrays, start + low, start + high):
            lo, hi = lo - start, hi - start
            if piece is None:
                result[lo:hi] = 0
                continue
            parts = [s[lo:hi] for s in slots]
            parts[self.mesh.rank] = piece
            sum_into(result[lo:hi], parts)

    def _run(self, first: int, count: int) -> np.ndarray:
        """The result regions `first` to `first + count - 1`, always as the same array."""
        if (first, count) not in self._runs:
            self._runs[first, count] = self.segment.regions(first, count)
        return self._runs[first, count]

    def _held(self) -> int:
        """The result regions this worker still has views of, as a bit mask."""
        held = 0
        for first, count in self._runs:
            # The dict's reference and getrefcount's argument; each view adds one.
            if sys.getrefcount(self._runs[first, count]) > 2:
                held |= ((1 << count) - 1) << first
        return held

    def all_reduce(self, seq: int, layout: Layout, arrays: list[np.ndarray],
                   out: np.ndarray) -> None:
        """out = the sum over workers of each worker's `arrays` in `layout`."""
        per_chunk = self.segment.chunk_bytes // layout.dtype.itemsize
        connections = list(self.mesh.connections.values())
        for part, start in enumerate(range(0, layout.size, per_chunk)):
            stop = min(layout.size, start + per_chunk)
            generation = self._next_generation()
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
            generation = self._next_generation()
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
        mine = struct.pack("!Q8s", layout.nbytes, _dtype_name(layout.dtype))
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

    def _publish(self, layout, held: int) -> tuple[int, int]:
        """Writes this worker's signature for the current chunk and the regions it holds,
        then its chunk count."""
        mine = (layout.nbytes, dtype_code(layout.dtype))
        line, field = self._lines[self.mesh.rank], 1 + 2 * ((self._chunks - 1) % 2)
        line[field:field + 2] = mine
        line[_HELD] = held
        line[WRITTEN] = self._chunks  # after the slot and the rest: x86-64 keeps this order
        return mine

    def _announce_and_poll(self, seq, generation, layout, held: int = 0) -> None:
        mine = self._publish(layout, held)
        for rank, connection in self.mesh.connections.items():
            theirs = self._lines[rank]
            if theirs[WRITTEN] < self._chunks:
                self._poll(theirs, connection, WRITTEN)
            size, dtype = (int(v) for v in theirs[1 + 2 * generation:3 + 2 * generation])
            if (size, dtype) != mine:
                _mismatch(connection, seq, (size, dtype.to_bytes(8, "little").rstrip(b"\0")
                                            .decode("ascii", "replace")), layout)

    def _poll(self, line: np.ndarray, connection, field: int) -> None:
        """Returns once `line[field]` counts this worker's chunks; raises if its peer is lost."""
        start = time.perf_counter()
        checked = start
        connection.waiting = True
        try:
            while line[field] < self._chunks:
                now = time.perf_counter()
                if now - checked > CHECK_SECONDS:
                    connection.check_alive()
                    checked = now
                if now - start > _YIELD_SECONDS:
                    time.sleep(_SLEEP_SECONDS)
                elif now - start > _SPIN_SECONDS:
                    os.sched_yield()
        finally:
            connection.waiting = False
            self.waited += time.perf_counter() - start


def dtype_code(dtype: np.dtype) -> int:
    """`dtype` as the counters' lines publish it (its name's first 8 bytes, an int64)."""
    return int.from_bytes(_dtype_name(dtype), "little")


@functools.cache
def _dtype_name(dtype: np.dtype) -> bytes:
    """What a worker says it sums: the first 8 bytes of the dtype's name (numpy takes
    ~5 us to name a dtype, at every collective)."""
    return dtype.name.encode()[:8]


def _mismatch(connection, seq, theirs, layout) -> None:
    raise ProtocolError(
        f"{connection.peer} sums {theirs} as collective {seq} while this worker sums "
        f"{(layout.nbytes, layout.dtype.name)}: the workers run different models, bucket "
        "sizes or code.")
