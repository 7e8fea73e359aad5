"""What tf_distrib's strategies do when their input iterators are made and dropped.

- Made: building one makes TensorFlow lower glibc's mmap threshold (`tf_distrib.strategy._malloc`);
  each new iterator restores it.
- Dropped: tearing one down blocks. Keras makes a new iterator for every epoch of a
  finite dataset (two, in fact: one as an epoch ends, another as the next begins), and
  the old iterator's destructor joins its tf.data threads, which under
  MultiWorkerMirroredStrategy took 4-15 s per epoch (measured on TF 2.21: epochs of
  200 steps of 25 ms took 20 s instead of 5 s; TF's autotuning thread accounts for
  about 10 s, and turning autotuning off still left 4 s), while the other workers wait
  in the next step's collective. Kept alive, the old iterators cost nothing, so each
  spent iterator of a dataset given to `fit` goes to one background thread, which drops
  it once nobody else refers to it: TensorFlow releases the GIL while it joins the
  threads. (`distribute_dataset` builds its pipelines without autotuning instead,
  `tf_distrib.data._input_stalls`: they tear down in ~0.2 s.)
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time

from tf_distrib.strategy import _malloc

# How long the reaper waits for the others (Keras' epoch loop) to drop a spent
# iterator; after that it lets go, and whoever drops it last tears it down.
RELEASE_TIMEOUT = 120.0
# How long an exiting process waits for a teardown under way.
EXIT_TIMEOUT = 60.0
_POLL_SECONDS = 0.05

# Distributed dataset class -> its subclass with this module's `__iter__`.
_SUBCLASSES: dict[type, type] = {}
_reaper: _Reaper | None = None
_reaper_lock = threading.Lock()


class _Reaper:
    """One daemon thread that drops spent iterators once it holds the last reference.

    At exit it finishes the teardown under way (for at most `EXIT_TIMEOUT` seconds) and
    leaves the rest to the interpreter: a daemon thread still inside TensorFlow's
    teardown when Python finalizes is unwound through C++ code that cannot be unwound,
    and the process aborts ("FATAL: exception not rethrown").
    """

    def __init__(self):
        self._spent: queue.SimpleQueue = queue.SimpleQueue()
        self._exiting = threading.Event()
        self._left: list = []  # iterators not torn down at exit
        self._thread = threading.Thread(target=self._run, name="tf_distrib-iterator-reaper",
                                        daemon=True)
        self._thread.start()
        atexit.register(self._stop)

    def retire(self, iterator) -> None:
        self._spent.put(iterator)

    def _stop(self) -> None:
        self._exiting.set()
        self._spent.put(None)
        self._thread.join(EXIT_TIMEOUT)

    def _run(self) -> None:
        while (iterator := self._spent.get()) is not None:
            deadline = time.monotonic() + RELEASE_TIMEOUT
            # This frame's reference and getrefcount's argument.
            while (sys.getrefcount(iterator) > 2 and time.monotonic() < deadline
                   and not self._exiting.is_set()):
                self._exiting.wait(_POLL_SECONDS)
            if self._exiting.is_set():
                self._left.append(iterator)
                return
            del iterator  # the teardown runs here, if ours was the last reference


def _retire(iterator) -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = _Reaper()
    _reaper.retire(iterator)


def managed(dataset, retire: bool):
    """`dataset` (a distributed dataset) with its iterators set up, and retired as above.

    Its class becomes a subclass of its own, so `isinstance` checks (Keras' data
    adapters make them) still hold.

    Args:
        dataset: A distributed dataset of a tf_distrib strategy.
        retire: Tear its spent iterators down on the background thread. Worth it for
            pipelines whose teardown blocks for seconds (any the user built, with
            tf.data's autotuning on); `distribute_dataset`'s take ~0.2 s, and the
            background thread would make an exiting worker wait for one (a preempted
            worker must exit as promptly as its peers).
    """
    cls = type(dataset)
    if cls not in _SUBCLASSES.values():
        dataset.__class__ = _SUBCLASSES.get(cls) or _SUBCLASSES.setdefault(cls, _subclass(cls))
    dataset.__dict__["_tf_distrib_retire"] = retire
    return dataset


def _subclass(cls: type) -> type:
    def __iter__(self):
        iterator = cls.__iter__(self)
        _malloc.restore_threshold()
        if self.__dict__["_tf_distrib_retire"]:
            previous = self.__dict__.get("_tf_distrib_iterator")
            self.__dict__["_tf_distrib_iterator"] = iterator
            if previous is not None:
                _retire(previous)
        return iterator

    return type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__})
