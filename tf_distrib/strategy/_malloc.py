"""Keeps glibc from unmapping and re-faulting a training step's buffers on every step.

Building a tf.distribute input iterator makes TensorFlow call
`mallopt(M_MMAP_THRESHOLD, 128 KiB)`, which turns off glibc's dynamic threshold: every
buffer over 128 KiB is then a fresh mmap, faulted in and zeroed on every step (about 9%
of an MWMS worker's CPU on the benchmark MLP). The strategies of `make_strategy()` set
the threshold to glibc's maximum (32 MiB) each time TensorFlow has built one of their
input iterators. `TF_DISTRIB_MMAP_THRESHOLD` sets another threshold in bytes; 0 keeps
TensorFlow's. glibc only; elsewhere nothing changes.
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
