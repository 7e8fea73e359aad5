"""The newest training state in host memory that outlives the workers (a launcher's /dev/shm).

`tf-distrib launch` makes one directory per host in /dev/shm, names it to its workers
(`contract.ENV_SNAPSHOT_DIR`) and deletes it when the launch ends, whatever the end. The
workers of a host share the work: every replica holds the same state, so local worker r
of n copies only the r-th of n equal byte ranges of it, into its own file. Each file has
two slots, written in turn, so the previous snapshot stays whole while the next is
written: a host holds at most 2x the state. A slot is committed by its end counter
catching up with its begin counter; a slot whose writer died in between is skipped.
Numpy only: no TensorFlow.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct
from collections.abc import Callable

import numpy as np

_MAGIC = b"tfdsnap1"
# magic, begin counter, end counter, length of the JSON description that follows.
_FIXED = struct.Struct("<8sQQQ")
_PAGE = mmap.PAGESIZE
# Room for the per-snapshot fields (step, epoch, ...) beyond the layout's description.
_SPARE_JSON = 1024
_FILE = re.compile(r"^part-(\d+)-of-(\d+)\.([01])$")


class MemorySnapshot:
    """One worker's part of its host's snapshots, and what the host's parts restore.

    Args:
        directory: The host's snapshot directory (`contract.snapshot_dir()`).
        part: This worker's index among the host's workers.
        parts: The host's workers.

    Example:

    ```python
    snapshot = MemorySnapshot("/dev/shm/tf_distrib-snapshots-1234-ab12", part=0, parts=1)
    weights = [np.ones(4, "float32")]
    snapshot.write(60, {"epoch": 1}, [("model/0", np.float32, (4,))], weights.__getitem__)
    manifest, arrays = snapshot.read(60)
    ```
    """

    def __init__(self, directory: str, part: int, parts: int):
        if not 0 <= part < parts:
            raise ValueError(f"part must be in [0, {parts}), got {part}.")
        self.directory, self.part, self.parts = directory, part, parts
        self._maps: dict[int, tuple[mmap.mmap, int, str]] = {}  # slot -> (map, offset, layout)

    def write(self, step: int, metadata: dict, specs: list[tuple[str, np.dtype, tuple]],
              read: Callable[[int], np.ndarray]) -> None:
        """Copies this worker's byte range of the whole state for global `step`.

        Args:
            step: The global step the state is at.
            metadata: What else the restore needs (JSON).
            specs: (name, dtype, shape) of each array of the state, in order.
            read: Returns array i of `specs`; called only for the arrays in this
                worker's byte range.
        """
        layout = json.dumps([[name, np.dtype(dtype).name, list(shape)]
                             for name, dtype, shape in specs])
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, dtype, shape in specs]
        low, high = _byte_range(sum(sizes), self.part, self.parts)
        slot = self._older_slot()
        block, offset = self._mapped(slot, layout, high - low)
        fixed = _FIXED.unpack_from(block, 0)
        counter = max(fixed[1], fixed[2]) + 1
        _FIXED.pack_into(block, 0, _MAGIC, counter, fixed[2], 0)  # torn until the end
        description = json.dumps({"step": step, "metadata": metadata, "layout": layout,
                                  "part": self.part, "parts": self.parts,
                                  "bytes": sum(sizes)})
        encoded = description.encode()
        if len(encoded) > offset - _FIXED.size:
            raise ValueError(f"snapshot metadata too large ({len(encoded)} bytes)")
        block[_FIXED.size:_FIXED.size + len(encoded)] = encoded
        _copy(sizes, read, low, np.frombuffer(block, np.uint8, high - low, offset))
        _commit(block, counter, len(encoded))

    def indices(self, specs: list[tuple[str, np.dtype, tuple]]) -> list[int]:
        """The arrays of `specs` that this worker's byte range holds a part of."""
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, dtype, shape in specs]
        low, high = _byte_range(sum(sizes), self.part, self.parts)
        starts = np.cumsum([0, *sizes])
        return [i for i, size in enumerate(sizes)
                if size and starts[i] < high and starts[i] + size > low]

    def steps(self) -> list[int]:
        """Steps whose every part this host holds, newest first."""
        return sorted(_complete(self.directory), reverse=True)

    def read(self, step: int) -> tuple[dict, dict[str, np.ndarray]]:
        """(manifest, arrays) of the snapshot of `step`, in `BackupStore.read_latest`'s form.

        Raises:
            KeyError: this host holds no complete snapshot of `step`.
        """
        parts = _complete(self.directory).get(step)
        if parts is None:
            raise KeyError(f"no complete snapshot of step {step} in {self.directory}")
        blob, description = bytearray(), None
        for path in parts:
            description, data = _read_slot(path)
            blob += data
            if description is None or description["step"] != step:  # rewritten meanwhile
                raise KeyError(f"the snapshot of step {step} was replaced while read")
        arrays, position = {}, 0
        for name, dtype, shape in json.loads(description["layout"]):
            dtype = dtype_named(dtype)
            size = int(np.prod(shape)) * dtype.itemsize
            arrays[name] = np.frombuffer(bytes(blob[position:position + size]),
                                         dtype).reshape(shape)
            position += size
        return {"step": step, "metadata": description["metadata"]}, arrays

    def close(self, delete: bool = False) -> None:
        """Unmaps this part's slots; `delete` also deletes them (a finished `fit`'s).

        Args:
            delete: Delete this part's files too. Defaults to False.
        """
        for block, _, _ in self._maps.values():
            block.close()
        self._maps.clear()
        if delete:
            for slot in (0, 1):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(slot))

    def _path(self, slot: int) -> str:
        return os.path.join(self.directory, f"part-{self.part}-of-{self.parts}.{slot}")

    def _older_slot(self) -> int:
        """The slot not holding this part's newest committed snapshot."""
        steps = [_slot_step(self._path(slot)) for slot in (0, 1)]
        if steps[0] is None:
            return 0
        return 1 if steps[1] is None or steps[1] < steps[0] else 0

    def _mapped(self, slot: int, layout: str, size: int) -> tuple[mmap.mmap, int]:
        """The slot's file mapped (made, or resized for a new layout): (map, data offset)."""
        kept = self._maps.get(slot)
        if kept is not None and kept[2] == layout:
            return kept[0], kept[1]
        if kept is not None:
            kept[0].close()
        offset = -(-(_FIXED.size + len(json.dumps(layout)) + _SPARE_JSON) // _PAGE) * _PAGE
        fd = os.open(self._path(slot), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != offset + size:
                os.ftruncate(fd, 0)  # a torn header, not a stale one, until committed
                os.ftruncate(fd, offset + size)
                # The memory now: a full /dev/shm is an OSError here, not a SIGBUS later.
                os.posix_fallocate(fd, 0, offset + size)
            block = mmap.mmap(fd, offset + size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._maps[slot] = (block, offset, layout)
        return block, offset


def dtype_named(name: str) -> np.dtype:
    """The dtype `np.dtype(...).name` names: numpy's, or ml_dtypes' (bfloat16, ...), whose
    `.str` is only "<V2"."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _copy(sizes: list[int], read, low: int, target: np.ndarray) -> None:
    """Copies bytes [low, low + target.size) of the arrays laid end to end into `target`."""
    position, high = 0, low + target.size
    for i, size in enumerate(sizes):
        start, end = max(low, position), min(high, position + size)
        if start < end:
            raw = np.asarray(read(i), order="C").reshape(-1).view(np.uint8)
            target[start - low:end - low] = raw[start - position:end - position]
        position += size


def _commit(block: mmap.mmap, counter: int, length: int) -> None:
    """Marks a slot whole: its end counter catches up with its begin counter."""
    _FIXED.pack_into(block, 0, _MAGIC, counter, counter, length)


def _byte_range(total: int, part: int, parts: int) -> tuple[int, int]:
    return total * part // parts, total * (part + 1) // parts


def _header(data) -> dict | None:
    """A slot's description if it is committed, else None."""
    if len(data) < _FIXED.size:
        return None
    magic, begin, end, length = _FIXED.unpack_from(data, 0)
    if magic != _MAGIC or begin != end or not begin or not length:
        return None
    try:
        return json.loads(bytes(data[_FIXED.size:_FIXED.size + length]))
    except ValueError:
        return None


def _read_header(path: str) -> dict | None:
    """The description of the slot file at `path` if it is committed, else None."""
    try:
        with open(path, "rb") as f:
            fixed = f.read(_FIXED.size)
            length = _FIXED.unpack(fixed)[3] if len(fixed) == _FIXED.size else 0
            return _header(fixed + f.read(length))
    except OSError:
        return None


def _read_slot(path: str) -> tuple[dict | None, bytes]:
    """A slot's description (None unless committed, before and after the read) and data."""
    with open(path, "rb") as f:
        data = f.read()
    description = _header(data)
    if description is None:
        return None, b""
    low, high = _byte_range(description["bytes"], description["part"], description["parts"])
    offset = len(data) - (high - low)
    # The writer of a later step may have begun meanwhile.
    if _read_header(path) != description or offset < _FIXED.size:
        return None, b""
    return description, data[offset:]


def _slot_step(path: str) -> int | None:
    description = _read_header(path)
    return None if description is None else description["step"]


def _complete(directory: str) -> dict[int, list[str]]:
    """step -> its parts' slot files, for each step whose every part is committed.

    Parts written by an attempt with another number of workers on this host are their
    own set: a step is complete when every part of one set holds it, with one layout.
    """
    found: dict[tuple[int, int], dict[int, tuple[str, str]]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    for name in names:
        match = _FILE.match(name)
        if not match:
            continue
        path = os.path.join(directory, name)
        description = _read_header(path)
        if description is not None and description["part"] == int(match[1]):
            found.setdefault((description["step"], int(match[2])), {})[int(match[1])] = (
                path, description["layout"])
    complete = {}
    for (step, parts), held in found.items():
        if len(held) == parts and len({layout for _, layout in held.values()}) == 1:
            complete[step] = [held[part][0] for part in range(parts)]
    return complete
