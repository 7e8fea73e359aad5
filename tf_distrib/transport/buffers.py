"""Flat, aligned buffers that the transport reduces in and hands to TensorFlow without a copy.

TensorFlow wraps a numpy array returned by `tf.numpy_function` without copying it when
its data is 64-byte aligned (measured on TF 2.21: a 7.4 MB result costs 0.3 ms less).
A bucket's tensors are laid out back to back, each starting on a 64-byte boundary, so
every output is an aligned view of one buffer. Buffers are reused once TensorFlow has
dropped every view of them: a fresh 7 MB buffer costs ~0.5 ms of page faults per step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np

ALIGN = 64
# Reused buffers kept for later collectives; more are freed when idle.
_IDLE_BUFFERS = 8
# Elements of 16-bit floats widened to float32 at a time (256 KiB: the core's L2 cache).
_WIDE_BLOCK = 1 << 16


def accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype sums of `dtype` are computed in: float32 for 16-bit floats."""
    return np.dtype(np.float32) if dtype.kind in "fV" and dtype.itemsize == 2 else dtype


def sum_into(target: np.ndarray, parts: list[np.ndarray]) -> None:
    """target = parts[0] + parts[1] + ..., added in that order (at least two parts).

    16-bit floats are summed in float32 and rounded once; numpy's own float16 and
    bfloat16 additions are 10-25x slower than float32's. They are summed a block at a
    time, so that the float32 copies stay in the core's cache instead of tripling the
    memory traffic. `target` may be a part.
    """
    wide = accumulator_dtype(target.dtype)
    if wide == target.dtype:
        np.add(parts[0], parts[1], out=target)
        for part in parts[2:]:
            np.add(target, part, out=target)
        return
    total, widened = np.empty((2, min(_WIDE_BLOCK, target.size)), wide)
    for start in range(0, target.size, _WIDE_BLOCK):
        stop = min(start + _WIDE_BLOCK, target.size)
        block, more = total[:stop - start], widened[:stop - start]
        block[...] = parts[0][start:stop]
        for part in parts[1:]:
            more[...] = part[start:stop]
            block += more
        target[start:stop] = block


class Layout:
    """Where each of a bucket's arrays lies in one flat buffer (64-byte aligned starts).

    Args:
        arrays: The bucket's arrays, all of one dtype.
    """

    def __init__(self, arrays: list[np.ndarray]):
        self.dtype = arrays[0].dtype
        if any(a.dtype != self.dtype for a in arrays):
            dtypes = sorted({str(a.dtype) for a in arrays})
            raise ValueError(f"A bucket holds one dtype, got {dtypes}.")
        step = max(1, ALIGN // self.dtype.itemsize)
        self.shapes = [a.shape for a in arrays]
        # Kept for `views`, which runs at every collective (`np.prod` of a shape: ~5 us).
        self.sizes = [a.size for a in arrays]
        self.starts, end = [], 0
        for size in self.sizes:
            self.starts.append(end)
            end += -(-size // step) * step
        self.size = end
        self.nbytes = end * self.dtype.itemsize

    def segments(self, arrays: list[np.ndarray], start: int,
                 stop: int) -> Iterator[tuple[int, int, np.ndarray | None]]:
        """Elements [start, stop) of the flat layout of `arrays`, as consecutive pieces.

        Yields:
            (lo, hi, piece): flat positions [lo, hi) and the elements there, a flat view
            of one of `arrays`, or None for the padding between arrays (zeros).
        """
        position = start
        for a, first in zip(arrays, self.starts, strict=True):
            lo, hi = max(position, first), min(stop, first + a.size)
            if lo >= hi:
                continue
            if position < lo:
                yield position, lo, None
            yield lo, hi, a.reshape(-1)[lo - first:hi - first]
            position = hi
        if position < stop:
            yield position, stop, None

    def gather(self, arrays: list[np.ndarray], start: int, stop: int, target: np.ndarray) -> None:
        """Copies elements [start, stop) of the flat layout of `arrays` into `target`."""
        for lo, hi, piece in self.segments(arrays, start, stop):
            target[lo - start:hi - start] = 0 if piece is None else piece

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """The arrays, shaped as given, as views of `flat` (the reduced layout)."""
        return [flat[s:s + n].reshape(shape)
                for s, n, shape in zip(self.starts, self.sizes, self.shapes, strict=True)]


class BufferPool:
    """64-byte aligned buffers, reused once nothing else refers to them."""

    def __init__(self):
        self._owners: list[np.ndarray] = []

    def take(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """A free aligned 1-D buffer of `nbytes` bytes viewed as `dtype`."""
        free = [i for i in range(len(self._owners)) if self._is_free(i)]
        fits = [i for i in free if self._owners[i].nbytes >= nbytes + ALIGN]
        if fits:
            owner = self._owners[fits[0]]
        else:
            for i in reversed(free[:max(0, len(free) + 1 - _IDLE_BUFFERS)]):
                del self._owners[i]
            owner = np.empty(nbytes + ALIGN, np.uint8)
            self._owners.append(owner)
        offset = (-owner.ctypes.data) % ALIGN
        return owner[offset:offset + nbytes].view(dtype)

    def _is_free(self, i: int) -> bool:
        # The pool's own reference and getrefcount's argument; each view handed out
        # (and kept alive by TensorFlow) adds one.
        return sys.getrefcount(self._owners[i]) <= 2

    def __len__(self) -> int:
        return len(self._owners)
