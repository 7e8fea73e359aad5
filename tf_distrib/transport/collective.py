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
import secrets
import socket
import threading
import time

import numpy as np

from tf_distrib import failure_report, phases
from tf_distrib.transport.buffers import BufferPool, Layout
from tf_distrib.transport.errors import PeerLostError, TransportError
from tf_distrib.transport.mesh import Mesh, TransportUnavailable
from tf_distrib.transport.ring import ring_all_reduce
from tf_distrib.transport.shared_memory import SharedMemoryReducer, SharedSegment, chunk_bytes_for
from tf_distrib.transport.store import Store

__all__ = ["Transport", "Stats", "connect", "MODES", "TransportUnavailable",
           "DEFAULT_PEER_TIMEOUT", "DEFAULT_CONNECT_TIMEOUT"]

#: Transports `make_strategy(transport=...)` accepts: "auto" (shared memory when every
#: worker is on one host, else TCP; TensorFlow's collective on GPUs), "tf" (TensorFlow's
#: collective), "tcp", "shm".
MODES = ("auto", "tf", "tcp", "shm")
DEFAULT_PEER_TIMEOUT = 30.0
DEFAULT_CONNECT_TIMEOUT = 120.0
# Collectives the flight recorder remembers.
RECORDED = 64
# How long a failing transport waits for its ABORT frames to leave.
ABORT_FLUSH_SECONDS = 1.0


@dataclasses.dataclass
class Stats:
    """What a transport has done: collectives, bytes summed, seconds spent in them."""

    collectives: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Transport:
    """Sums arrays across the workers of a `Mesh`: shared memory on one host, else a TCP ring.

    Every worker must call `all_reduce` with arrays of the same shapes and dtype, in
    the same order. Sums are bitwise identical on every worker.

    Args:
        mesh: The connected workers.
        segment: A shared-memory segment every worker has attached, or None for TCP.

    Attributes:
        mode: "shm" or "tcp".
        stats: A `Stats`.
        failure: The error that stopped the transport, or None.
    """

    def __init__(self, mesh: Mesh, segment: SharedSegment | None = None):
        self.mesh = mesh
        self.mode = "shm" if segment is not None else "tcp"
        self._segment = segment
        self._shm = SharedMemoryReducer(mesh, segment) if segment is not None else None
        self._results, self._scratch = BufferPool(), BufferPool()
        self._seq = 0
        self._lock = threading.Lock()
        self._recorder: collections.deque[dict] = collections.deque(maxlen=RECORDED)
        self.stats = Stats()
        self.failure: TransportError | None = None

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world(self) -> int:
        return len(self.mesh.peers)

    def all_reduce(self, arrays: list[np.ndarray], seq: int | None = None) -> list[np.ndarray]:
        """The element-wise sums of `arrays` over all workers (same shapes, one dtype).

        The results are views of one 64-byte aligned buffer, reused once they are gone.

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
        with self._lock:
            if self.failure is not None:
                raise self.failure
            seq = self._seq if seq is None else seq
            self._seq = seq + 1
            layout = Layout(arrays)
            record = {"seq": seq, "bytes": layout.nbytes, "started": time.time(), "ended": None}
            self._recorder.append(record)
            start = time.perf_counter()
            out = self._results.take(layout.nbytes, layout.dtype)
            try:
                if self._shm is not None:
                    self._shm.all_reduce(seq, layout, arrays, out)
                else:
                    layout.gather(arrays, 0, layout.size, out)
                    scratch = self._scratch.take(
                        (layout.size // self.world + 1) * layout.dtype.itemsize, layout.dtype)
                    ring_all_reduce(self.mesh, seq, out, scratch)
            except TransportError as e:
                self._stop(e)
                raise
            record["ended"] = time.time()
            if self.stats.collectives == 0:
                # Every peer took part in a collective: start-up is over.
                phases.enter(phases.TRAINING)
            self.stats.collectives += 1
            self.stats.bytes += layout.nbytes
            self.stats.seconds += time.perf_counter() - start
            return layout.views(out)

    def recent(self) -> list[dict]:
        """The last collectives (seq, bytes, started, ended: None while running), oldest first."""
        return [dict(r) for r in self._recorder]

    def waiting_for(self) -> list[str]:
        """The peers this worker is waiting for right now, inside a collective."""
        return [str(c.peer) for c in self.mesh.connections.values() if c.waiting]

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
            has room, else TCP), "tcp" or "shm". Defaults to "auto".
        timeout: Seconds for every worker to publish and connect. Defaults to 120.
        peer_timeout: Seconds of silence after which a peer counts as lost. Defaults to 30.
        prefix: Store key prefix, unique per transport within the job.
        shm_directory: Where the shared-memory segment is made. Defaults to "/dev/shm".

    Raises:
        TransportUnavailable: a worker cannot listen (all workers raise it together).
        TransportError: the workers did not connect, or "shm" was asked for but is
            not possible; the message says why.
    """
    if mode not in ("auto", "tcp", "shm"):
        raise ValueError(f"mode must be 'auto', 'tcp' or 'shm', got {mode!r}.")
    if secret is None:
        if rank == 0:
            store.set(f"{prefix}/secret", secrets.token_hex(32))
        secret = store.get(f"{prefix}/secret", timeout).encode()
    mesh = Mesh(rank, tasks, host, store, prefix, secret, timeout=timeout,
                peer_timeout=peer_timeout, extra={"host_id": _host_id(shm_directory)})
    segment, why = None, "the workers run on different hosts"
    if mode != "tcp" and len(tasks) > 1 and len({i["host_id"] for i in mesh.infos}) == 1:
        segment, why = _shared_segment(mesh, store, prefix, timeout, shm_directory)
    if mode == "shm" and segment is None and len(tasks) > 1:
        mesh.close()
        raise TransportError(f"transport='shm' is not possible here: {why}. Use 'auto' or "
                             "'tcp'.")
    return Transport(mesh, segment)


def _shared_segment(mesh: Mesh, store: Store, prefix: str, timeout: float,
                    directory: str) -> tuple[SharedSegment | None, str]:
    """One segment every worker attached, or (None, why not); every worker agrees."""
    world, segment = len(mesh.peers), None
    if mesh.rank == 0:
        try:
            segment, token = SharedSegment.create(world, chunk_bytes_for(world, directory),
                                                  directory)
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


