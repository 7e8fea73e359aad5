"""The same-host all-reduce as a TensorFlow op, built against the installed TensorFlow.

`native_sum.cc` runs the shared-memory reduce-scatter of `shared_memory.py` (same
segment, counters and sums, bitwise) inside a C++ op whose sums land in tensors
TensorFlow allocated, so optimizers update in place; two more ops fuse Keras' SGD step
(with or without momentum) into the collective (`NativeSum.sgd`). The op is built on
first use (`native_build`); where it cannot be built or loaded, the transport warns,
naming the cause, and keeps its Python path (`TF_DISTRIB_NATIVE_SUM=0` skips it). Its
waits cannot run Python: a watcher thread checks the peers' liveness and sets the op's
abort word when one is lost (`native_control`). The op records its last 64 collectives
for the flight recorder (`Transport.recent()`).

Example: `sums = transport.native.all_reduce(ticket, [gradient_a, gradient_b])`.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

from tf_distrib import contract
from tf_distrib.transport import native_build, native_control, shared_memory

# The control block's words after `native_control`'s: this process's tensors in each of
# the two update regions, the SGD steps that updated through a region, and those that
# found their variables there.
_HELD = native_control.WORDS
_REGION_UPDATES, _IN_PLACE_UPDATES = _HELD + 2, _HELD + 3
# What an SGD step's collective publishes where a sum publishes its dtype's name, so that
# a peer running another kind of collective on as many bytes is told apart, not summed.
_SGD_CODE = int.from_bytes(b"f32 sgd", "little")
_MOMENTUM_CODE = int.from_bytes(b"f32 mom", "little")


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


class NativeSum(native_control.ControlBlock):
    """The op bound to one transport's segment (its control block and watcher:
    `native_control.ControlBlock`).

    It sums float32 (gradients, logged values) and int64 (TensorFlow's per-step count of
    the workers whose input still has data, with a plain dataset).

    Args:
        transport: The `Transport` ("shm" mode, polled counters) whose collectives it runs.
        segment: Its `SharedSegment`; stays mapped until the process exits.
        op_library: `library()`.
    """

    DTYPES = ("float32", "int64")

    def __init__(self, transport, segment, op_library):
        mapped = segment.array()
        super().__init__(transport, _IN_PLACE_UPDATES + 1, kept=(mapped,))
        self._library = op_library
        update_regions, region_bytes = segment.update_regions()
        self._attrs = dict(
            segment=mapped.ctypes.data, control=self.address,
            rank=transport.rank, world=transport.world, chunk_bytes=segment.chunk_bytes,
            header_bytes=shared_memory.HEADER_BYTES, lines=shared_memory.COUNTERS_OFFSET,
            line_bytes=shared_memory.LINE_BYTES, written=shared_memory.WRITTEN,
            summed=shared_memory.SUMMED, offered=shared_memory.OFFERED,
            update_regions=update_regions, region_bytes=region_bytes)

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
