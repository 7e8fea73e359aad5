"""`Transport`: sums numpy arrays across workers over shared memory or TCP, and `connect()`.

Example (outside TensorFlow, workers sharing a directory):

```python
from tf_distrib import transport

t = transport.connect(rank, ["worker:0", "worker:1"], "127.0.0.1",
                      transport.FileStore("/shared/rendezvous"), secret=b"job secret")
[total] = t.all_reduce([np.ones(1000, np.float32)])      # 2.0 everywhere
t.close()
```

Under MultiWorkerMirroredStrategy `make_strategy()` connects one for you (through
TensorFlow's coordination service) and runs the gradient all-reduce on it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import secrets
import socket
import sys
import threading
import time

import numpy as np

from tf_distrib.health import failure_report, phases
from tf_distrib.transport import native_exchange, native_sum, ring
from tf_distrib.transport.buffers import BufferPool, Layout
from tf_distrib.transport.errors import PeerLostError, TransportError
from tf_distrib.transport.mesh import Mesh, SubMesh, TransportUnavailable
from tf_distrib.transport.shared_memory import (
    MIN_CHUNK_BYTES,
    SharedMemoryReducer,
    SharedSegment,
    chunk_bytes_for,
)
from tf_distrib.transport.store import Store

__all__ = ["Transport", "Stats", "connect", "MODES", "TransportUnavailable",
           "DEFAULT_PEER_TIMEOUT", "DEFAULT_CONNECT_TIMEOUT"]

#: Transports `make_strategy(transport=...)` accepts: "auto" (shared memory when every
#: worker is on one host; shared memory within hosts and TCP between them when hosts run
#: the same number of workers; else TCP; TensorFlow's collective on GPUs), "tf"
#: (TensorFlow's collective), "tcp", "shm".
MODES = ("auto", "tf", "tcp", "shm")
DEFAULT_PEER_TIMEOUT = 30.0
DEFAULT_CONNECT_TIMEOUT = 120.0
# Collectives the flight recorder remembers.
RECORDED = 64
# How long a failing transport waits for its ABORT frames to leave.
ABORT_FLUSH_SECONDS = 1.0
# How often `finish` checks that the collective thread still runs.
_FINISH_CHECK_SECONDS = 1.0
# How long `close` waits for the collective under way (there is none after training).
_CLOSE_SECONDS = 5.0


@dataclasses.dataclass
class Stats:
    """What a transport has done: collectives, bytes summed, seconds spent in them."""

    collectives: int = 0
    bytes: int = 0
    seconds: float = 0.0
    #: Collectives whose sums stayed in shared memory (each worker summed its part).
    in_place: int = 0
    #: Of `seconds`, those spent waiting for a peer's part (shared memory's counters, the
    #: native op's waits, TCP frames still in flight).
    waited: float = 0.0


class _Job:
    """One collective: its number, layout and result buffer, and how it ended."""

    __slots__ = ("seq", "layout", "out", "record", "done", "error")

    def __init__(self, seq: int, layout: Layout):
        self.seq, self.layout = seq, layout
        self.out: np.ndarray | None = None
        self.record = {"seq": seq, "bytes": layout.nbytes, "started": time.time(), "ended": None}
        self.done = threading.Event()
        self.error: TransportError | None = None


class Transport:
    """Sums arrays across the workers of a `Mesh`: shared memory, TCP, or both.

    - "shm": every worker on one host sums through one shared-memory segment;
    - "tcp": a ring over the mesh's TCP connections (one worker per host, or hosts
      with different numbers of workers);
    - "shm+tcp" (hierarchical, several hosts with the same number L > 1 of workers
      each): the workers of a host sum through their host's segment; each then owns
      1/L of the host's sum and ring-all-reduces it with the workers of the same
      local index on the other hosts (L rings at once, each on 1/L of the bytes, so
      every core of the host drives part of the network traffic); then each copies
      the other slices from its host's segment. Each host sends 2(H-1)/H of the
      buffer over its link for H hosts, against 2(N-1)/N for a flat ring of all N
      workers, and nothing goes over TCP between two workers of one host.

    Every worker must call `all_reduce` (or `start`) with arrays of the same shapes and
    dtype, in the same order. Sums are bitwise identical on every worker.

    Across hosts the collectives run on the transport's own thread, one at a time in
    the order they were started (`overlaps`): `start` copies the arrays and returns,
    `finish` waits for the sum, so the caller computes while the bytes cross the link
    (TensorFlow gives a worker pinned to one core a single inter-op thread, which a
    collective that blocked would take from the backward pass). On one host the
    collective runs in the caller (shared memory is CPU work: a hand-off would only
    add to it).

    Args:
        mesh: The connected workers.
        segment: A shared-memory segment every worker of this host has attached, or
            None for TCP.
        hosts: The mesh's ranks grouped by host, for "shm+tcp". Defaults to None: every
            worker on this host ("shm") when there is a segment.

    Attributes:
        mode: "shm", "tcp" or "shm+tcp".
        overlaps: Whether `start` returns before the collective is done (not "shm").
        stats: A `Stats`; its seconds are those the caller spent waiting in collectives.
        failure: The error that stopped the transport, or None.
    """

    def __init__(self, mesh: Mesh, segment: SharedSegment | None = None,
                 hosts: list[list[int]] | None = None):
        self.mesh = mesh
        self._segment = segment
        self._shm = self._across = None
        if segment is not None and hosts and len(hosts) > 1:
            mine = next(group for group in hosts if mesh.rank in group)
            local = SubMesh.of(mesh, mine)
            self._shm = SharedMemoryReducer(local, segment)
            self._across = SubMesh.of(mesh, [group[local.rank] for group in hosts])
        elif segment is not None:
            self._shm = SharedMemoryReducer(mesh, segment)
        self.mode = "tcp" if segment is None else "shm+tcp" if self._across else "shm"
        self.overlaps = self.mode != "shm"
        self._results, self._scratch = BufferPool(), BufferPool()
        self._seq = 0
        self._lock = threading.Lock()
        self._recorder: collections.deque[dict] = collections.deque(maxlen=RECORDED)
        self._started: dict[int, _Job] = {}
        self._stats = Stats()
        self._python_waited = 0.0  # the Python path's waits already in `_stats`
        self.failure: TransportError | None = None
        #: The native ops' library (`native_sum.library()`), when every worker loaded it
        #: (`connect` asks them all), else None.
        self.op_library = None
        #: Its all-reduce op bound to the segment (`native_sum.NativeSum`; "shm" only),
        #: or None.
        self.native = None
        #: Its op for small all-reduces over sockets of its own
        #: (`native_exchange.NativeExchange`; "tcp" only), or None.
        self.exchange = None
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if self.overlaps:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, daemon=True,
                                            name=f"tf_distrib-collectives-{mesh.rank}")
            self._thread.start()

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world(self) -> int:
        return len(self.mesh.peers)

    @property
    def stats(self) -> Stats:
        """What this transport has done, the native ops' collectives included."""
        for op in self._native_ops:
            op.fold_stats(self._stats)
        waited = (self._shm.waited if self._shm is not None else 0.0) + sum(
            c.waited for c in self.mesh.connections.values())
        self._stats.waited += waited - self._python_waited
        self._python_waited = waited
        return self._stats

    @property
    def in_place_bytes(self) -> int | None:
        """One slot of shared memory ("shm" with polled counters), or None: the largest
        bucket whose sum stays there with room for the sums of 3 more. A layout of up
        to 4 slots also stays there, in as many result regions; a larger one is summed
        in full by every worker and copied out."""
        return self._shm.in_place_bytes if self._shm is not None and not self._across else None

    def all_reduce(self, arrays: list[np.ndarray], seq: int | None = None) -> list[np.ndarray]:
        """The element-wise sums of `arrays` over all workers (same shapes, one dtype).

        The results are views of one 64-byte aligned buffer, reused once they are gone.
        On one host they are often read-only views of shared memory that every
        worker's results view (`tf_distrib.transport.shared_memory`).

        Args:
            arrays: This worker's arrays.
            seq: The collective's number, the same on every worker and increasing.
                Defaults to None: the number of collectives this transport ran.

        Raises:
            PeerLostError: a peer died, closed, aborted or fell silent; the message names it.
            ProtocolError: a peer sent something else than this worker expects.
        """
        if not arrays:
            return []
        return self.finish(self.start(arrays, seq))

    def start(self, arrays: list[np.ndarray], seq: int | None = None) -> int:
        """Starts `all_reduce(arrays, seq)`; `finish` returns its sums.

        When the transport `overlaps`, this returns once the arrays are copied, before
        the collective is done; the arrays may then be reused.

        Returns:
            The collective's number, for `finish`.

        Raises:
            TransportError: the transport has stopped (its failure).
        """
        began = time.perf_counter()
        with self._lock:
            if self.failure is not None:
                raise self.failure
            seq = self._seq if seq is None else seq
            self._seq = seq + 1
            layout = Layout(arrays)
            job = _Job(seq, layout)
            self._recorder.append(job.record)
            self._started[seq] = job
            if self._jobs is None:
                self._run(job, layout, arrays)
            else:
                job.out = self._results.take(layout.nbytes, layout.dtype)
                layout.gather(arrays, 0, layout.size, job.out)
                self._jobs.put(job)
        self._stats.seconds += time.perf_counter() - began
        return seq

    def finish(self, seq: int) -> list[np.ndarray]:
        """Waits for collective `seq` (from `start`) and returns its sums.

        Raises:
            PeerLostError: a peer died, closed, aborted or fell silent; the message names it.
            ProtocolError: a peer sent something else than this worker expects.
            TransportError: the transport's thread is gone.
        """
        began = time.perf_counter()
        with self._lock:
            job = self._started.pop(seq, None)
        if job is None:
            raise ValueError(f"Collective {seq} was not started, or has finished already.")
        # Its ring and shared-memory waits end within the peer timeout; this one only
        # guards against a thread that died of something else.
        while not job.done.wait(_FINISH_CHECK_SECONDS):
            if self._thread is None or not self._thread.is_alive():
                raise TransportError("the transport's collective thread is gone (closed?).")
        self._stats.seconds += time.perf_counter() - began
        if job.error is not None:
            raise job.error
        return job.layout.views(job.out)

    def _serve(self) -> None:
        """The collective thread: runs started collectives in order, until `close`."""
        while (job := self._jobs.get()) is not None:
            # `start` has gathered the arrays into the result buffer.
            self._run(job, Layout([job.out]), [job.out])

    def _run(self, job: _Job, layout: Layout, arrays: list[np.ndarray]) -> None:
        try:
            if self.failure is not None:
                raise self.failure
            # Across hosts (`overlaps`) `start` has gathered the arrays into job.out.
            shm, across = self._shm, self._across
            if shm is not None and shm.in_place_bytes is not None and (
                    across is not None or shm.fits_in_place(layout)):
                job.out, in_place = shm.all_reduce_scattered(
                    job.seq, layout, arrays, self._results.take, across, self._scratch.take)
                self._stats.in_place += in_place
            elif across is not None:
                self._hierarchical_all_reduce(job.seq, layout, arrays, job.out)
            elif shm is not None:
                job.out = self._results.take(layout.nbytes, layout.dtype)
                shm.all_reduce(job.seq, layout, arrays, job.out)
            else:
                ring.all_reduce(self.mesh, job.seq, job.out, self._scratch.take)
        except TransportError as e:
            if self.failure is None:
                self._stop(e)
            job.error = e
        else:
            job.record["ended"] = time.time()
            if self._stats.collectives == 0:
                # Every peer took part in a collective: start-up is over.
                phases.enter(phases.TRAINING)
            self._stats.collectives += 1
            self._stats.bytes += layout.nbytes
        finally:
            job.done.set()

    def _hierarchical_all_reduce(self, seq, layout, arrays, out) -> None:
        """Without polled counters: the host's sum on each of its workers, a ring across
        hosts of each worker's slice of it, then an all-gather in the host."""
        self._shm.all_reduce(seq, layout, arrays, out)
        local = self._shm.mesh
        n = len(local.peers)
        bounds = [layout.size * c // n for c in range(n + 1)]
        mine = out[bounds[local.rank]:bounds[local.rank + 1]]
        ring.all_reduce(self._across, seq, mine, self._scratch.take)
        self._shm.all_gather(seq, layout, bounds, out)

    def recent(self) -> list[dict]:
        """The last collectives (seq, bytes, started, ended: None while running or failed),
        oldest first, the native ops' among them."""
        records = [dict(r) for r in self._recorder]
        for op in self._native_ops:
            records = sorted([*records, *op.recent()], key=lambda r: r["started"])[-RECORDED:]
        return records

    def waiting_for(self) -> list[str]:
        """The peers this worker is waiting for right now, inside a collective."""
        native = {op.waiting_for() for op in self._native_ops}
        return [str(c.peer) for r, c in self.mesh.connections.items()
                if c.waiting or r in native]

    @property
    def _native_ops(self) -> list:
        return [op for op in (self.native, self.exchange) if op is not None]

    def _stop(self, error: TransportError) -> None:
        """Remembers `error` and tells every peer, so that each fails fast, naming the cause."""
        self.failure = error
        if isinstance(error, PeerLostError):
            failure_report.write_failure(self.mesh.peers[self.rank].task, str(error), self,
                                          lost_peer=error.peer.task)
        me = self.mesh.peers[self.rank]
        aborts = [c.abort(f"{me} stopped its transport: {error}")
                  for c in self.mesh.connections.values()]
        # A worker that exits right after this would close its links before the frames
        # leave, and its peers would blame it instead of the culprit it names.
        deadline = time.monotonic() + ABORT_FLUSH_SECONDS
        for request in aborts:
            request.done.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Says goodbye to every peer and releases the connections and the segment."""
        for op in self._native_ops:
            op.close()
        if self._jobs is not None:
            self._jobs.put(None)
            self._thread.join(_CLOSE_SECONDS)
        self.mesh.close()
        if self._segment is not None:
            self._segment.close()
            self._segment = None


def connect(rank: int, tasks: list[str], host: str, store: Store, *,
            secret: bytes | None = None, mode: str = "auto",
            timeout: float = DEFAULT_CONNECT_TIMEOUT,
            peer_timeout: float = DEFAULT_PEER_TIMEOUT, prefix: str = "tf_distrib/transport",
            shm_directory: str = "/dev/shm") -> Transport:
    """Connects this worker to every other one and returns their `Transport`.

    Args:
        rank: This worker's position in `tasks`.
        tasks: Every worker's task name ("worker:0", ...), the same list on every worker.
        host: The address this worker listens on (its TF_CONFIG host) and peers dial.
        store: Where workers publish their addresses (`CoordinationServiceStore` under
            MWMS, `FileStore` otherwise).
        secret: The job's secret. Defaults to None: worker 0 draws one and shares it
            through `store` (as safe as the store itself; the launcher passes its own).
        mode: "auto" (shared memory when every worker shares this host and /dev/shm
            has room; "shm+tcp" when several hosts run the same number of workers,
            more than one each; else TCP), "tcp" or "shm". Defaults to "auto".
        timeout: Seconds for every worker to publish and connect. Defaults to 120.
        peer_timeout: Seconds of silence after which a peer counts as lost. Defaults to 30.
        prefix: Store key prefix, unique per transport within the job. Defaults to
            "tf_distrib/transport".
        shm_directory: Where the shared-memory segment is made. Defaults to "/dev/shm".

    Raises:
        TransportUnavailable: a worker cannot listen (all workers raise it together).
        TransportError: the workers did not connect, or "shm" was asked for but is
            not possible; the message says why.

    Example:

    ```python
    t = transport.connect(rank, ["worker:0", "worker:1"], "10.0.0.5",
                          transport.FileStore("/shared/rendezvous"), secret=b"...")
    [total] = t.all_reduce([np.ones(1000, np.float32)])
    t.close()
    ```
    """
    if mode not in ("auto", "tcp", "shm"):
        raise ValueError(f"mode must be 'auto', 'tcp' or 'shm', got {mode!r}.")
    if secret is None:
        if rank == 0:
            store.set(f"{prefix}/secret", secrets.token_hex(32))
        secret = store.get(f"{prefix}/secret", timeout).encode()
    # Loaded (built, the first time on a machine) before this worker publishes itself.
    library = _op_library()
    mesh = Mesh(rank, tasks, host, store, prefix, secret, timeout=timeout,
                peer_timeout=peer_timeout, extra={"host_id": _host_id(shm_directory),
                                                  "native_ops": library is not None})
    hosts = list(_by_host(mesh).values())
    segment, why = None, "the workers run on different hosts"
    if mode == "auto" and len(hosts) > 1 and len({len(g) for g in hosts}) == 1 < len(hosts[0]):
        segment = _hierarchical_segment(mesh, hosts, store, prefix, timeout, shm_directory)
    elif mode != "tcp" and len(tasks) > 1 and len(hosts) == 1:
        segment, why = _shared_segment(mesh, store, prefix, timeout, shm_directory)
    if mode == "shm" and segment is None and len(tasks) > 1:
        mesh.close()
        raise TransportError(f"transport='shm' is not possible here: {why}. Use 'auto' or "
                             "'tcp'.")
    transport = Transport(mesh, segment, hosts)
    # PowerSGD's native ops round otherwise than TensorFlow's, and every worker must
    # rebuild the same bits: the workers take them only if every one loaded them.
    if all(info.get("native_ops") for info in mesh.infos):
        transport.op_library = library
        if transport.mode == "shm" and transport.in_place_bytes is not None:
            transport.native = native_sum.NativeSum(transport, segment, library)
        elif transport.mode == "tcp" and len(tasks) > 1:
            try:
                lanes = Mesh(rank, tasks, host, store, f"{prefix}/exchange", secret,
                             timeout=timeout, peer_timeout=peer_timeout,
                             link=native_exchange.plain_socket)
            except TransportError:
                transport.close()
                raise
            transport.exchange = native_exchange.NativeExchange(transport, lanes, library)
    return transport


def _op_library():
    """The native ops' library, or None: disabled, not loadable, or TensorFlow not
    imported (the ops serve TensorFlow's graphs)."""
    if native_sum.enabled() and "tensorflow" in sys.modules:
        return native_sum.library()
    return None


def _by_host(mesh: Mesh) -> dict[str, list[int]]:
    """The mesh's ranks grouped by host, hosts in the order of their first rank."""
    hosts: dict[str, list[int]] = {}
    for r, info in enumerate(mesh.infos):
        hosts.setdefault(info["host_id"], []).append(r)
    return hosts


def _hierarchical_segment(mesh: Mesh, hosts: list[list[int]], store: Store, prefix: str,
                          timeout: float, directory: str) -> SharedSegment | None:
    """This host's segment for "shm+tcp", or None (every worker then uses the TCP ring).

    Every host makes its own; all workers use them only if every host succeeded.
    """
    index = next(i for i, group in enumerate(hosts) if mesh.rank in group)
    # A worker ring-reduces its part of each slot-sized chunk with its peers on the other
    # hosts, so every host's slots are as large as the smallest host's.
    try:
        mine = chunk_bytes_for(len(hosts[index]), directory)
    except OSError:
        mine = MIN_CHUNK_BYTES  # no segment here either: `_shared_segment` says why
    store.set(f"{prefix}/chunk_bytes/{mesh.rank}", str(mine))
    chunk_bytes = min(int(store.get(f"{prefix}/chunk_bytes/{r}", timeout))
                      for r in range(len(mesh.peers)))
    segment, why = _shared_segment(SubMesh.of(mesh, hosts[index]), store,
                                   f"{prefix}/host{index}", timeout, directory, chunk_bytes)
    store.set(f"{prefix}/hierarchical/{mesh.rank}", why)
    if any(store.get(f"{prefix}/hierarchical/{r}", timeout) != "ok"
           for r in range(len(mesh.peers))):
        if segment is not None:
            segment.close()
        return None
    return segment


def _shared_segment(mesh: Mesh | SubMesh, store: Store, prefix: str, timeout: float,
                    directory: str, chunk_bytes: int | None = None
                    ) -> tuple[SharedSegment | None, str]:
    """One segment every worker of `mesh` attached, or (None, why not); they all agree.

    Its slots are of `chunk_bytes`, or, when None (the default), as large as `directory`
    has room for.
    """
    world, segment = len(mesh.peers), None
    if mesh.rank == 0:
        try:
            segment, token = SharedSegment.create(
                world, chunk_bytes or chunk_bytes_for(world, directory), directory)
            offer = {"path": segment.path, "token": token}
        except OSError as e:
            offer = {"error": f"cannot make a shared-memory segment in {directory} "
                              f"({e.strerror or e})"}
        store.set(f"{prefix}/shm", json.dumps(offer))
    offer = json.loads(store.get(f"{prefix}/shm", timeout))
    outcome = offer.get("error", "ok")
    if mesh.rank != 0 and "error" not in offer:
        try:
            segment = SharedSegment.attach(offer["path"], offer["token"], world)
        except OSError as e:
            outcome = f"{mesh.peers[mesh.rank]} cannot map {offer['path']} ({e.strerror or e})"
    store.set(f"{prefix}/shm/{mesh.rank}", outcome)
    outcomes = [store.get(f"{prefix}/shm/{r}", timeout) for r in range(world)]
    if mesh.rank == 0 and segment is not None:
        segment.unlink()  # everyone has attached (or given up)
    problems = sorted({o for o in outcomes if o != "ok"})
    if problems:
        if segment is not None:
            segment.close()
        return None, "; ".join(problems)
    return segment, "ok"


def _host_id(shm_directory: str) -> str:
    """Equal for processes that share a host and its shared-memory file system."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        device = os.stat(shm_directory).st_dev
    except OSError:
        device = None
    return f"{socket.gethostname()}|{boot}|{device}"


