"""Destroys distributed datasets' iterators off the training thread.

Destroying one of TF 2.21's distributed iterators (its MultiDeviceIterator) can block
the destroying thread for seconds: measured 0.1-5 s, often 2.5 s or 5 s, at random.
Keras `fit` drops one or two iterators per epoch on the training thread, so a
2-worker MultiWorkerMirroredStrategy epoch of 2.5 s took 5 to 10 s (`make bench` ->
`scaling`). `reap_iterators(dataset)` makes the dataset hand every iterator it
creates to one background thread, which keeps it until nothing else refers to it
and then drops it, so the wait happens there.
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading

# Poll period of the reaper thread, in seconds.
_POLL = 0.5
# An iterator kept alive by a reference cycle never becomes idle; past this many held
# iterators the oldest is released anyway (and Python's collector destroys it).
_MAX_HELD = 16
# At exit, how long to wait for the reaper to finish destroying iterators. A daemon
# thread still inside TensorFlow when Python finalizes aborts the process.
_EXIT_TIMEOUT = 30.0


class _Reaper:
    def __init__(self):
        self._held: list = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def hold(self, iterator) -> None:
        with self._wake:
            self._held.append(iterator)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tf_distrib-reaper",
                                                daemon=True)
                self._thread.start()
                atexit.register(self._stop)
            self._wake.notify()

    def held(self) -> int:
        with self._wake:
            return len(self._held)

    def _stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(_EXIT_TIMEOUT)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._held or self._stopping)
                if self._stopping:
                    released, self._held = self._held, []
                    break
                # Two references (the list's and getrefcount's argument) mean that
                # nobody else uses the iterator any more.
                idle = [i for i in range(len(self._held))
                        if sys.getrefcount(self._held[i]) == 2]
                overflow = max(0, len(self._held) - len(idle) - _MAX_HELD)
                drop = set(idle) | set(range(overflow))
                released = [it for i, it in enumerate(self._held) if i in drop]
                self._held = [it for i, it in enumerate(self._held) if i not in drop]
            released.clear()  # the iterators are destroyed here, on this thread
            with self._wake:
                self._wake.wait(_POLL)
        released.clear()


_REAPER = _Reaper()


def reap_iterators(dataset) -> None:
    """Makes `dataset` (a tf.distribute distributed dataset) give its iterators to the reaper."""
    dataset.__class__ = _reaping_class(type(dataset))


@functools.cache
def _reaping_class(base: type) -> type:
    def __iter__(self):
        iterator = base.__iter__(self)
        _REAPER.hold(iterator)
        return iterator

    return type(base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__,
                                         "__doc__": base.__doc__})
