"""What binds a native collective op to its transport: its control block and watcher.

The ops (`native_sum`, over shared memory; `native_exchange`, over TCP) wait in C++,
where Python cannot run. Each reads and writes a control block of int64 words in this
process's memory (`native_control.h` has its layout): an abort word and message, the
peer it waits for, its stats, and a flight recorder of its last 64 collectives. A
watcher thread checks, while the op waits, that the peer it waits for is alive (the
transport's connection to it: its heartbeats, its end), and when one is lost stops the
transport and sets the abort word with the transport's error: the op then fails with it.
"""

from __future__ import annotations

import os
import select
import threading

import numpy as np

from tf_distrib.health import phases
from tf_distrib.transport import shared_memory
from tf_distrib.transport.errors import TransportError

# The control block: int64 words, as native_control.h reads them, the abort message, the
# flight recorder's ring (number, bytes, started, ended: wall-clock nanoseconds); an op's
# own words follow from WORDS on.
_ABORT, _WAITING_FOR, _NANOSECONDS, _COLLECTIVES, _BYTES, _WAKE_FD, _RECORDED, _WAITED = range(8)
# The words `fold_stats` adds to the transport's `Stats`.
_STATS_WORDS = [_NANOSECONDS, _COLLECTIVES, _BYTES, _WAITED]
_MESSAGE_OFFSET, _MESSAGE_BYTES = 64, 960
_RECORDER_WORD, _RECORDER_ENTRIES, _ENTRY_WORDS = 128, 64, 4
WORDS = _RECORDER_WORD + _RECORDER_ENTRIES * _ENTRY_WORDS
# Every control block and wake pipe, and what an op's attributes point to (a segment,
# sockets), kept until the process exits: a traced step that still holds their
# addresses or descriptors can run after its transport is gone, and must then fail (the
# control block says the transport is closed), never touch unmapped memory or write into
# a descriptor that names another file by then.
_KEPT: list[tuple] = []


class ControlBlock:
    """A native op's control block, and the watcher that can abort the op's waits.

    Args:
        transport: The `Transport` whose collectives the op runs.
        words: The block's int64 words: `WORDS` and the op's own. Defaults to `WORDS`.
        kept: What the op's attributes point to, kept as the block is (see `_KEPT`).
            Defaults to nothing.
    """

    def __init__(self, transport, words: int = WORDS, kept: tuple = ()):
        self.transport = transport
        self._control = np.zeros(words, np.int64)
        # The op writes a byte here when its first collective completes, so that the
        # watcher says TRAINING at once (the launcher names a stopped worker's phase),
        # and when a peer's connection ends under it.
        self._wake = os.pipe()
        os.set_blocking(self._wake[1], False)
        self._control[_WAKE_FD] = self._wake[1]
        _KEPT.append((self._control, self._wake, *kept))
        self._folded = np.zeros(len(_STATS_WORDS), np.int64)  # those already in `stats`
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"tf_distrib-native-watch-{transport.rank}")
        self._watcher.start()

    @property
    def address(self) -> int:
        """The block's address, the ops' `control` attribute."""
        return self._control.ctypes.data

    def waiting_for(self) -> int | None:
        """The rank the op waits for right now, or None."""
        peer = int(self._control[_WAITING_FOR]) - 1
        return peer if peer >= 0 else None

    def recent(self) -> list[dict]:
        """The op's last collectives, as `Transport.recent()` lists them, oldest first."""
        count = int(self._control[_RECORDED])
        ring = self._control[_RECORDER_WORD:WORDS].reshape(_RECORDER_ENTRIES, _ENTRY_WORDS)
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
