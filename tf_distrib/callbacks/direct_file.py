"""Writing a local file past the page cache (O_DIRECT), where the file system allows it."""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

# O_DIRECT wants the memory address, the length and the file offset of each write
# aligned to the device's logical block: 4096 covers 512- and 4096-byte blocks.
ALIGN = 4096
_STAGE_BYTES = 8 << 20


class DirectFile:
    """A new local file whose bytes go from memory to the device, not the page cache.

    A backup is written once and read only after a restart, so caching it costs and
    gives nothing: a buffered write of 529 MB spent 0.4-1.3 s of kernel time allocating
    page cache on the development VM (the pages a deleted backup freed go back to the
    host and are faulted in again), an O_DIRECT write 0.22-0.25 s with almost no CPU.
    O_DIRECT wants aligned memory, lengths and offsets: aligned chunks are written as
    they are, others through an aligned staging buffer; the last block is padded and
    the file cut back to its size on `close`, which also makes the file durable
    (fsync: O_DIRECT skips the page cache, not the device's cache nor the file's size
    and blocks in the file system's journal). Where the file system refuses O_DIRECT
    (tmpfs, or a platform without it), the same calls write through the page cache;
    `direct` says which.

    Args:
        path: The file to create (replaced if it exists).

    Example:

    ```python
    with DirectFile("/tmp/state.bin") as f:
        f.write(memoryview(b"any length"))
    ```
    """

    def __init__(self, path: str):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        try:
            self._fd = os.open(path, flags | direct, 0o644)
            self.direct = bool(direct)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            self._fd, self.direct = os.open(path, flags, 0o644), False
        self._stage = mmap.mmap(-1, _STAGE_BYTES)  # page aligned
        self._filled = 0
        self._size = 0

    def write(self, chunk) -> None:
        """Appends `chunk` (bytes or a memoryview).

        Memory aligned to 4096 bytes, written at a file offset that is too, goes to
        the device as it is; the rest is copied through the staging buffer.
        """
        chunk = memoryview(chunk).cast("B")
        if (self.direct and self._size % ALIGN == 0 and len(chunk) >= ALIGN
                and np.frombuffer(chunk, np.uint8).ctypes.data % ALIGN == 0):
            self._flush()  # whole blocks: the last flush and this offset are aligned
            whole = len(chunk) - len(chunk) % ALIGN
            self._write_all(chunk[:whole])
            self._size += whole
            chunk = chunk[whole:]
        while chunk:
            n = min(len(chunk), _STAGE_BYTES - self._filled)
            self._stage[self._filled:self._filled + n] = chunk[:n]
            self._filled += n
            self._size += n
            chunk = chunk[n:]
            if self._filled == _STAGE_BYTES:
                self._flush()

    def close(self) -> None:
        """Writes what is staged, cuts the file to its exact size and makes it durable."""
        if self._fd < 0:
            return
        try:
            if self.direct and self._filled % ALIGN:
                padded = -(-self._filled // ALIGN) * ALIGN
                self._stage[self._filled:padded] = bytes(padded - self._filled)
                self._filled = padded
                self._flush()
                os.ftruncate(self._fd, self._size)
            else:
                self._flush()
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
            self._stage.close()

    def _flush(self) -> None:
        with memoryview(self._stage) as stage:
            self._write_all(stage[:self._filled])
        self._filled = 0

    def _write_all(self, view: memoryview) -> None:
        while view:
            try:
                view = view[os.write(self._fd, view):]
            except OSError as e:
                # A file system can take the flag at open and refuse the writes.
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                import fcntl  # only where O_DIRECT exists, so never on Windows

                fcntl.fcntl(self._fd, fcntl.F_SETFL,
                            fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
