"""Keeps glibc from unmapping and re-faulting a training step's buffers on every step.

Building a tf.distribute input iterator makes TensorFlow call
`mallopt(M_MMAP_THRESHOLD, 128 KiB)` (`tensorflow::data::ApplyPython311MemoryPatch`, run
when a `GeneratorDataset` kernel is built; TF's `MultiDeviceIterator` builds one). That
turns off glibc's dynamic threshold, which would otherwise rise to 32 MiB as large buffers
are freed: from then on every buffer over 128 KiB (activations, gradients, oneDNN's GEMM
scratch) is a fresh mmap that the kernel faults in and zeroes, and unmaps when freed, on
every step. Plain Keras without a strategy never builds that kernel. Measured on
`make bench`'s scaling model (TF 2.21): 33,000 page faults a second per MWMS worker against
3 without a strategy, ~9% of the worker's CPU; with the threshold below, 100 a second and
+9% examples/s.

The strategies of `make_strategy()` set the threshold to glibc's maximum (32 MiB; trim
threshold twice that, as glibc's dynamic rule would) each time TensorFlow has built one
of their input iterators (`tf_distrib._input_iterators`). `TF_DISTRIB_MMAP_THRESHOLD`
sets another threshold in bytes; 0 keeps TensorFlow's (its patch limits heap growth in
`Dataset.from_generator` pipelines under Python 3.11+). glibc only; elsewhere nothing
changes.
"""

from __future__ import annotations

import ctypes
import functools
import platform

from tf_distrib import contract

#: glibc's largest M_MMAP_THRESHOLD on 64-bit systems, the ceiling of its dynamic rule.
MAX_THRESHOLD = 32 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def threshold() -> int:
    """The threshold to keep, in bytes (0: keep TensorFlow's).

    Raises:
        ValueError: TF_DISTRIB_MMAP_THRESHOLD is not an integer from 0 to 32 MiB.
    """
    value = contract.env_int(contract.ENV_MMAP_THRESHOLD, MAX_THRESHOLD)
    if value > MAX_THRESHOLD:
        raise ValueError(f"{contract.ENV_MMAP_THRESHOLD}={value} is above glibc's maximum "
                         f"({MAX_THRESHOLD} bytes). Set at most {MAX_THRESHOLD}, or 0 to keep "
                         "TensorFlow's threshold.")
    return value


@functools.cache
def _mallopt():
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None).mallopt


def restore_threshold() -> bool:
    """Sets glibc's mmap threshold (and trim threshold) to `threshold()`.

    Returns:
        True if glibc took the setting; False where it is off, or not glibc.
    """
    value, mallopt = threshold(), _mallopt()
    if not value or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, value)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                    2 * value))
