"""The same-host all-reduce as a TensorFlow op, built against the installed TensorFlow.

`native_sum.cc` runs the shared-memory reduce-scatter of `shared_memory.py` (same
segment, counters and sums, bitwise) inside a C++ op whose sums land in tensors
TensorFlow allocated, so optimizers update in place; two more ops fuse Keras' SGD step
(with or without momentum) into the collective (`NativeSum.sgd`). The op is built on
first use (`native_build`); where it cannot be built or loaded, the transport warns,
naming the cause, and keeps its Python path (`TF_DISTRIB_NATIVE_SUM=0` skips it). Its
waits cannot run Python: a watcher thread checks the peers' liveness and sets the op's
abort word when one is lost. The op records its last 64 collectives for the flight
recorder (`Transport.recent()`).

Example: `sums = transport.native.all_reduce(ticket, [gradient_a, gradient_b])`.
"""

from __future__ import annotations

import functools
import os
import select
import threading
import warnings

import numpy as np

from tf_distrib import contract
from tf_distrib.health import phases
from tf_distrib.transport import native_build, shared_memory
from tf_distrib.transport.errors import TransportError

# The control block: int64 words, as native_sum.cc reads them, the abort message, the
# flight recorder's ring (number, bytes, started, ended: wall-clock nanoseconds), then the
# SGD steps' words: this process's tensors in each of the two update regions, the steps
# that updated through a region, and those that found their variables there.
_ABORT, _WAITING_FOR, _NANOSECONDS, _COLLECTIVES, _BYTES, _WAKE_FD, _RECORDED, _WAITED = range(8)
# The words `fold_stats` adds to the transport's `Stats`.
_STATS_WORDS = [_NANOSECONDS, _COLLECTIVES, _BYTES, _WAITED]
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


@functools.cache
def library():
    """The loaded op library, built first if need be; None (and one warning) if it cannot be.

    Imports TensorFlow.
    """
    import tensorflow as tf

    try:
        path = native_build.library_path(
            [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()], tf.__version__)
    except native_build.BuildFailed as e:
        return _without_the_op(f"it cannot be built: {e}")
    try:
        return tf.load_op_library(path)
    except (OSError, tf.errors.OpError) as e:
        return _without_the_op(f"{path} did not load ({e}); "
                               "`tf-distrib doctor --rebuild` builds it again")


def _without_the_op(cause: str) -> None:
    warnings.warn(
        f"tf_distrib: the native ops are not used: {cause}. The shared-memory transport "
        "keeps its Python path (~0.5 ms more CPU per step for 7 MB of gradients), PowerSGD "
        f"TensorFlow's ops; set {contract.ENV_NATIVE_SUM}=0 to silence this.", RuntimeWarning,
        stacklevel=3)


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
        self._folded = np.zeros(len(_STATS_WORDS), np.int64)  # those already in `stats`
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"tf_distrib-native-watch-{transport.rank}")
        self._watcher.start()

    def all_reduce(self, ticket, tensors):
        """The sums over workers of `tensors` (all of one of `DTYPES`), after the op that
        made `ticket`."""
        code = shared_memory.dtype_code(np.dtype(tensors[0].dtype.as_numpy_dtype))
        return self._library.tf_distrib_shared_sum(ticket, tensors, dtype_code=code,
                                                   name="tf_distrib_all_reduce", **self._attrs)

    def sgd(self, ticket, step, gradients):
        """Keras' SGD `step` (an `SgdStep`) on the sums over workers of `gradients`
        (float32), each worker computing its part, after the op that made `ticket`:
        assigns the step's variables bitwise the values Keras' step gives on
        `all_reduce`'s sums.

        Returns:
            The op (None when run eagerly).
        """
        handles = [v.handle for v in step.variables]
        if step.velocities is None:
            return self._library.tf_distrib_shared_sgd(
                ticket, step.learning_rate, gradients, handles, dtype_code=_SGD_CODE,
                name="tf_distrib_all_reduce_sgd", **self._attrs)
        return self._library.tf_distrib_shared_momentum(
            ticket, step.learning_rate, step.momentum, gradients, handles,
            [v.handle for v in step.velocities], nesterov=step.nesterov,
            dtype_code=_MOMENTUM_CODE, name="tf_distrib_all_reduce_momentum", **self._attrs)

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
        now = self._control[_STATS_WORDS]
        nanoseconds, collectives, nbytes, waited = (int(v) for v in now - self._folded)
        self._folded = now
        stats.seconds += nanoseconds / 1e9
        stats.collectives += collectives
        stats.bytes += nbytes
        stats.waited += waited / 1e9

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

