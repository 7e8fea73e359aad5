"""Host memory that holds a copy of the training state while a backup is written."""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Pieces copied in parallel: big enough that a thread's start-up is noise, small enough to
# spread one large variable over the threads.
_PIECE_BYTES = 16 << 20
_PAGE = mmap.PAGESIZE
# The memory of the last released snapshot, lent to the next one in this process (see
# `HostSnapshot.release`): at most one block, and only where the kernel can take its pages
# back lazily (MADV_FREE: Linux >= 4.5, macOS).
_MADV_FREE = getattr(mmap, "MADV_FREE", None)
_spare: list[mmap.mmap] = []
_spare_lock = threading.Lock()
RELEASE_THREAD_NAME = "tf_distrib-release"


class HostSnapshot:
    """Copies named arrays into one block of host memory kept from one save to the next.

    The block is mapped and touched once (for as long as the names, shapes and dtypes
    stay the same), so a save costs one parallel memcpy of the state and no page
    faults; once released, it is lent to the next snapshot in the process (the next
    `fit`'s), which then maps nothing. Two alternatives were measured on the backup
    benchmark (529 MB) and rejected: a snapshot that keeps TensorFlow's buffers alive
    makes TensorFlow copy each variable the next step updates into freshly mapped
    memory (0.1-1.2 s per save, against 0.03 s for this copy); and numpy's own large
    arrays ask for transparent huge pages, which this VM's kernel compacts memory for
    on the first touch (1.2 s of kernel time for 529 MB, against 0.2 s for the 4 KiB
    pages of a plain mapping).

    Args:
        threads: Copy threads. Defaults to the host's cores, at most 4.

    Example:

    ```python
    snapshot = HostSnapshot()
    copies = snapshot.copy([("w", np.ones((1024, 1024), "float32"))])
    ```
    """

    def __init__(self, threads: int | None = None):
        self._threads = threads or min(os.cpu_count() or 1, 4)
        self._layout: list[tuple[str, tuple, np.dtype]] = []
        self._buffers: list[np.ndarray] = []
        self._block: mmap.mmap | None = None

    def allocate(self, specs: list[tuple[str, tuple, np.dtype]]) -> None:
        """Maps and touches memory for (name, shape, dtype) arrays, unless it already is.

        Run off the training thread, this takes the page faults out of the first save.
        """
        layout = [(name, tuple(shape), np.dtype(dtype)) for name, shape, dtype in specs]
        if layout == self._layout:
            return
        # Each array starts on a page: a local backup writes it to disk without a copy.
        sizes = [-(-int(np.prod(shape)) * dtype.itemsize // _PAGE) * _PAGE
                 for _, shape, dtype in layout]
        size = max(sum(sizes), _PAGE)
        self._block = block = _borrow(size) or mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # One byte a page faults each page in (the kernel zeroes it), or takes a lent one
        # back. One thread: the page faults cost kernel time more than bandwidth, and a
        # core that training leaves free takes them all. Not MADV_POPULATE_WRITE: it takes
        # less CPU (0.15 s against 0.17-0.2 s for 529 MB) but holds the address-space lock
        # while it runs, and TensorFlow's own mappings wait (`fit` +4-6% against +1.3% on
        # the backup benchmark with a core left free).
        np.frombuffer(block, np.uint8, size)[::_PAGE] = 0
        offsets = np.cumsum([0] + sizes[:-1])
        self._buffers = [
            np.frombuffer(block, dtype, int(np.prod(shape)), int(offset)).reshape(shape)
            for (_, shape, dtype), offset in zip(layout, offsets, strict=True)]
        self._layout = layout

    def copy(self, arrays: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
        """Copies `arrays` into the kept memory; returns (name, copy) pairs in order."""
        arrays = [(name, np.asarray(source)) for name, source in arrays]
        self.allocate([(name, source.shape, source.dtype) for name, source in arrays])
        pieces = []
        for (_, source), buffer in zip(arrays, self._buffers, strict=True):
            flat_buffer, flat_source = buffer.reshape(-1), np.ravel(source)
            step = max(_PIECE_BYTES // max(buffer.itemsize, 1), 1)
            pieces += [(flat_buffer[i:i + step], flat_source[i:i + step])
                       for i in range(0, buffer.size, step)]
        with ThreadPoolExecutor(self._threads) as pool:
            list(pool.map(lambda piece: np.copyto(*piece), pieces))  # numpy drops the GIL
        return [(name, buffer) for (name, _), buffer in zip(arrays, self._buffers, strict=True)]

    def release(self) -> None:
        """Drops the memory; the next snapshot in this process may reuse it.

        Mapping and faulting in 529 MB takes 0.15-0.2 s of kernel time; reusing a
        released block takes 0.01-0.03 s. So where the kernel can take pages back
        lazily (MADV_FREE), the block is kept for the next snapshot (the next `fit`'s)
        and the kernel reclaims its pages whenever it needs memory, without writing
        them anywhere (a reclaimed page comes back as zeros on its next touch).
        Elsewhere it is unmapped.
        """
        block, self._block, self._layout, self._buffers = self._block, None, [], []
        if block is not None:  # 0.01-0.09 s: not on the training thread
            threading.Thread(target=_lend, args=(block,), name=RELEASE_THREAD_NAME,
                             daemon=True).start()


def _lend(block: mmap.mmap) -> None:
    """Offers `block` to the next snapshot; the spare it replaces is unmapped."""
    if _MADV_FREE is None:
        return  # dropping the block unmaps it
    try:
        block.madvise(_MADV_FREE)
    except OSError:  # a kernel older than 4.5
        return
    with _spare_lock:
        _spare[:] = [block]


def _borrow(size: int) -> mmap.mmap | None:
    """The spare block when it holds `size` bytes (its pages past them stay lent).

    A smaller spare is dropped, which unmaps it.
    """
    with _spare_lock:
        block = _spare.pop() if _spare else None
    return block if block is not None and len(block) >= size else None
