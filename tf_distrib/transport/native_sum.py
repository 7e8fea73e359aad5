"""The same-host all-reduce as a TensorFlow op, built against the installed TensorFlow.

`tf.numpy_function` hands TensorFlow its results as memory TensorFlow does not own, and
a kernel may overwrite only a buffer it owns: the optimizer's update then writes a new
7.4 MB buffer every step instead of updating the MLP's gradients in place, and every
collective pays the function's Python. `native_sum.cc` runs the shared-memory
reduce-scatter of `shared_memory.py` (same segment, counters and sums, bitwise) inside a
C++ op whose sums land in tensors TensorFlow allocated. Measured on the MLP of `bench
scaling`, 2 workers x 1 core, the two paths alternating by epoch within one run: 0.67
ms less CPU per step (median of 9 pairs; the whole exchange had cost 1.2 ms). Two more
ops take Keras' SGD step (with or without momentum) inside the same collective
(`NativeSum.sgd`): each worker updates its part of the weights and copies the others'
parts, 0.2-0.3 ms less CPU per step for that MLP, 0.65 ms with momentum. Where nothing
else refers to it, each worker writes its part into one of the segment's two update
regions instead, in place once the variables hold it: one copy of the weights for all
workers, nothing copied back (see native_sum.cc).

The op is compiled on first use (~10 s, `make` does it at install) with the C++ compiler
in `$CXX` (default `c++`) and the flags of `tf.sysconfig`, into
`$XDG_CACHE_HOME/tf_distrib` (default ~/.cache/tf_distrib), once per TensorFlow version
and source. Where it cannot be built or loaded, the transport warns once and keeps its
Python path; `TF_DISTRIB_NATIVE_SUM=0` keeps the Python path without trying.

Its waits cannot run Python, so each worker's watcher thread checks its peers' liveness
while the op waits (as the Python path's polling does) and, when one is lost, stops the
transport and sets the op's abort word: the op fails with the same message, naming the
peer. The op wakes that thread through a pipe when its first collective completes, and
the thread then reports the TRAINING phase (the launcher names the phase of a worker
that stops; polling alone let a fast worker stop at its 15th step still "in its first
step"). The op records its last 64 collectives in the control block, for the flight
recorder's reports (`Transport.recent()`): the one a hung worker waits in has no end.

Example (what `tf_distrib.transport.graph_op` does with a transport whose `native` is
set):

```python
sums = transport.native.all_reduce(ticket, [gradient_a, gradient_b])
```
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import select
import shutil
import subprocess
import threading
import time
import warnings

import numpy as np

from tf_distrib import contract, phases
from tf_distrib.transport import shared_memory
from tf_distrib.transport.errors import TransportError

SOURCE = os.path.join(os.path.dirname(__file__), "native_sum.cc")
# A first build takes ~10 s on one core; its peers wait for it (`connect`'s timeout).
BUILD_TIMEOUT_SECONDS = 60.0
# No fused multiply-adds: the op's SGD step rounds as TensorFlow's multiply and subtract.
_CXXFLAGS = ("-shared", "-fPIC", "-O3", "-ffp-contract=off", "-w")
# The control block: int64 words, as native_sum.cc reads them, the abort message, the
# flight recorder's ring (number, bytes, started, ended: wall-clock nanoseconds), then the
# SGD steps' words: this process's tensors in each of the two update regions, the steps
# that updated through a region, and those that found their variables there.
_ABORT, _WAITING_FOR, _NANOSECONDS, _COLLECTIVES, _BYTES, _WAKE_FD, _RECORDED = range(7)
_MESSAGE_OFFSET, _MESSAGE_BYTES = 64, 960
_RECORDER_WORD, _RECORDER_ENTRIES, _ENTRY_WORDS = 128, 64, 4
_HELD = _RECORDER_WORD + _RECORDER_ENTRIES * _ENTRY_WORDS
_REGION_UPDATES, _IN_PLACE_UPDATES = _HELD + 2, _HELD + 3
_CONTROL_BYTES = 8 * (_IN_PLACE_UPDATES + 1)
# What an SGD step's collective publishes where a sum publishes its dtype's name, so that
# a peer running another kind of collective on as many bytes is told apart, not summed.
_SGD_CODE = int.from_bytes(b"f32 sgd", "little")
_MOMENTUM_CODE = int.from_bytes(b"f32 mom", "little")
# Every bound segment, control block and wake pipe, kept until the process exits: a
# traced step that still holds their addresses can run after its transport is gone, and
# must then fail (the control block says the transport is closed), never touch unmapped
# memory or write into a descriptor that names another file by then.
_KEPT: list[tuple[np.ndarray, np.ndarray, tuple[int, int]]] = []


def enabled() -> bool:
    """Whether this process may use the op: `TF_DISTRIB_NATIVE_SUM` is unset or 1, not 0.

    Raises:
        ValueError: the variable is set to anything else; the message names it.
    """
    value = contract.env_int(contract.ENV_NATIVE_SUM, 1)
    if value not in (0, 1):
        raise ValueError(f"{contract.ENV_NATIVE_SUM}={value} must be 0 (the transport's "
                         "Python path) or 1 (the native op, the default). Fix or unset it.")
    return value == 1


def compiler() -> str | None:
    """The C++ compiler that builds the op (`$CXX`, default `c++`), or None if missing."""
    return shutil.which(os.environ.get("CXX", "c++"))


@functools.cache
def library():
    """The loaded op library, built first if need be; None (and one warning) if it cannot be.

    Imports TensorFlow.
    """
    import tensorflow as tf

    try:
        path = _built(tf)
        return tf.load_op_library(path)
    except (OSError, subprocess.SubprocessError, tf.errors.OpError) as e:
        warnings.warn(
            f"tf_distrib: the native all-reduce op could not be built or loaded ({e}); "
            "the shared-memory transport keeps its Python path (~0.5 ms more CPU per step "
            "for 7 MB of gradients). Install a C++ compiler (g++) or set CXX; set "
            f"{contract.ENV_NATIVE_SUM}=0 to silence this.", RuntimeWarning, stacklevel=2)
        return None


def _built(tf) -> str:
    """The path of the op's shared library for this TensorFlow, compiled if missing."""
    cxx = compiler()
    if cxx is None:
        raise OSError(f"no C++ compiler: {os.environ.get('CXX', 'c++')} is not on PATH")
    flags = [*_CXXFLAGS, *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, tf.__version__.encode(), cxx.encode(),
                                     *(flag.encode() for flag in flags)])).hexdigest()[:16]
    directory = os.path.join(os.environ.get("XDG_CACHE_HOME")
                             or os.path.expanduser("~/.cache"), "tf_distrib")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"native_sum-{key}.so")
    # Workers of one host start together: one builds, the others wait for its library.
    with open(path + ".lock", "w") as lock:
        _lock(lock, path)
        if not os.path.exists(path):
            partial = f"{path}.{os.getpid()}.tmp"
            try:
                done = subprocess.run(
                    [cxx, SOURCE, "-o", partial, *flags],
                    capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS)
                if done.returncode != 0:
                    raise OSError(f"{os.path.basename(cxx)} exited with {done.returncode}: "
                                  f"{done.stderr.strip()[-500:]}")
                os.replace(partial, path)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
    return path


def _lock(lock, path: str) -> None:
    """Takes the build's lock, waiting for another process's build as long as one may take."""
    deadline = time.monotonic() + BUILD_TIMEOUT_SECONDS + 10
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(f"another process has held {path}.lock for over "
                              f"{BUILD_TIMEOUT_SECONDS + 10:g} s") from None
            time.sleep(0.1)


class NativeSum:
    """The op bound to one transport's segment, and the watcher that can abort its waits.

    It sums float32 (gradients, logged values) and int64 (TensorFlow's per-step count of
    the workers whose input still has data, with a plain dataset).

    Args:
        transport: The `Transport` ("shm" mode, polled counters) whose collectives it runs.
        segment: Its `SharedSegment`; stays mapped until the process exits.
        op_library: `library()`.
    """

    DTYPES = ("float32", "int64")

    def __init__(self, transport, segment, op_library):
        self.transport = transport
        self._library = op_library
        self._control = np.zeros(_CONTROL_BYTES // 8, np.int64)
        # The op writes a byte here when its first collective completes, so that the
        # watcher says TRAINING at once (the launcher names a stopped worker's phase).
        self._wake = os.pipe()
        os.set_blocking(self._wake[1], False)
        self._control[_WAKE_FD] = self._wake[1]
        mapped = segment.array()
        _KEPT.append((mapped, self._control, self._wake))
        update_regions, region_bytes = segment.update_regions()
        self._attrs = dict(
            segment=mapped.ctypes.data, control=self._control.ctypes.data,
            rank=transport.rank, world=transport.world, chunk_bytes=segment.chunk_bytes,
            header_bytes=shared_memory.HEADER_BYTES, lines=shared_memory.COUNTERS_OFFSET,
            line_bytes=shared_memory.LINE_BYTES, written=shared_memory.WRITTEN,
            summed=shared_memory.SUMMED, offered=shared_memory.OFFERED,
            update_regions=update_regions, region_bytes=region_bytes)
        self._folded = np.zeros(3, np.int64)  # nanoseconds, collectives, bytes in `stats`
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"tf_distrib-native-watch-{transport.rank}")
        self._watcher.start()

    def all_reduce(self, ticket, tensors):
        """The sums over workers of `tensors` (all of one of `DTYPES`), after the op that
        made `ticket`."""
        code = shared_memory.dtype_code(np.dtype(tensors[0].dtype.as_numpy_dtype))
        return self._library.tf_distrib_shared_sum(ticket, tensors, dtype_code=code,
                                                   name="tf_distrib_all_reduce", **self._attrs)

    def sgd(self, ticket, learning_rate, gradients, weights, momentum=None, velocities=None,
            nesterov=False):
        """Keras' SGD step on the sums over workers of `gradients` (float32), each worker
        computing its part, after the op that made `ticket`: assigns the variables bitwise
        the values Keras' step gives on `all_reduce`'s sums.

        Args:
            ticket: The collective's number (`graph_op`).
            learning_rate: A float32 scalar.
            gradients: This worker's gradients.
            weights: The weights' `tf.Variable`s (this replica's), one per gradient.
            momentum: A float32 scalar, with `velocities`. Defaults to None (no momentum).
            velocities: The momentum's `tf.Variable`s, one per gradient. Defaults to None.
            nesterov: Nesterov's momentum. Defaults to False.

        Returns:
            The op (None when run eagerly).
        """
        handles = [v.handle for v in weights]
        if velocities is None:
            return self._library.tf_distrib_shared_sgd(
                ticket, learning_rate, gradients, handles, dtype_code=_SGD_CODE,
                name="tf_distrib_all_reduce_sgd", **self._attrs)
        return self._library.tf_distrib_shared_momentum(
            ticket, learning_rate, momentum, gradients, handles, [v.handle for v in velocities],
            nesterov=nesterov, dtype_code=_MOMENTUM_CODE, name="tf_distrib_all_reduce_momentum",
            **self._attrs)

    @property
    def region_updates(self) -> int:
        """The SGD steps so far whose new weights went to an update region, which every
        worker's variables then held (the others went to private buffers)."""
        return int(self._control[_REGION_UPDATES])

    @property
    def in_place_updates(self) -> int:
        """The `region_updates` that found this worker's variables in their region already
        (and nothing else holding them), and updated them there."""
        return int(self._control[_IN_PLACE_UPDATES])

    def waiting_for(self) -> int | None:
        """The rank the op waits for right now, or None."""
        peer = int(self._control[_WAITING_FOR]) - 1
        return peer if peer >= 0 else None

    def recent(self) -> list[dict]:
        """The op's last collectives, as `Transport.recent()` lists them, oldest first."""
        count = int(self._control[_RECORDED])
        ring = self._control[_RECORDER_WORD:_HELD].reshape(_RECORDER_ENTRIES, _ENTRY_WORDS)
        entries = [[int(word) for word in ring[i % _RECORDER_ENTRIES]]
                   for i in range(max(0, count - _RECORDER_ENTRIES), count)]
        return [{"seq": seq, "bytes": nbytes, "started": started / 1e9,
                 "ended": ended / 1e9 if ended else None}
                for seq, nbytes, started, ended in entries]

    def fold_stats(self, stats) -> None:
        """Adds the op's collectives since the last call to `stats` (a `Stats`)."""
        now = self._control[_NANOSECONDS:_BYTES + 1].copy()
        seconds, collectives, nbytes = (int(v) for v in now - self._folded)
        self._folded = now
        stats.seconds += seconds / 1e9
        stats.collectives += collectives
        stats.bytes += nbytes

    def close(self) -> None:
        """Stops the watcher; the op fails from now on, saying the transport is closed."""
        self._abort(TransportError("the transport is closed."))
        os.write(self._wake[1], b"\0")

    def _watch(self) -> None:
        """Checks, while the op waits, that the peer it waits for is alive; ends once the op
        is aborted (a lost peer, or `close`)."""
        while True:
            woken, _, _ = select.select([self._wake[0]], [], [], shared_memory.CHECK_SECONDS)
            if self._control[_ABORT]:
                return
            if woken:
                os.read(self._wake[0], 64)
            if self._control[_COLLECTIVES]:
                phases.enter(phases.TRAINING)  # every peer took part in a collective
            transport, peer = self.transport, self.waiting_for()
            try:
                if transport.failure is not None:
                    raise transport.failure
                if peer is not None:
                    transport.mesh.connections[peer].check_alive()
            except TransportError as e:
                if transport.failure is None:
                    transport._stop(e)
                self._abort(e)
                return

    def _abort(self, error: Exception) -> None:
        if self._control[_ABORT]:
            return
        # As Python prints it: the console and the launcher recognise it in the traceback.
        kind = type(error)
        message = f"{kind.__module__}.{kind.__qualname__}: {error}".encode("utf-8", "replace")
        message = message[:_MESSAGE_BYTES - 1] + b"\0"
        self._control.view(np.uint8)[_MESSAGE_OFFSET:_MESSAGE_OFFSET + len(message)] = (
            np.frombuffer(message, np.uint8))
        self._control[_ABORT] = 1  # after the message: x86-64 keeps stores in order

