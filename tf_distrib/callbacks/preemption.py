"""Agree on one step at which every worker saves after a SIGTERM (preemption).

SIGTERM reaches one worker, while every worker must save at the same step (saving
takes part in collectives). The first worker that sees the signal publishes a stop
step one past its own in the coordination service's key-value store; every worker
watches that key from a thread and, once it has read it, says so under a key of its
own. The announcing worker waits for every worker's word before it steps on: until
then no peer can finish a step that needs its gradients, so every peer learns the
stop step before it can pass it, however late its watching thread runs. (A watcher
that merely polls could learn it too late: the peer would step past the stop step
into a collective that the stopped worker never joins.) No collective runs per step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import tensorflow as tf

from tf_distrib import _compat
from tf_distrib.cluster import ClusterSpec

_STOP_MARGIN_STEPS = 1
_POLL_MS = 1000
_AGREE_MS = 60_000


class PreemptionWatcher:
    """Tells, at each step, whether this worker must save and exit now.

    Installs a SIGTERM handler (main thread only) until `close()`, or until the `fit`
    that `model` runs has ended: Keras does not call `on_train_end` when `fit` raises,
    so the handler checks that `fit` is still on the stack when a SIGTERM arrives,
    and otherwise restores the previous handler and hands it the signal.

    Args:
        spec: The cluster, when several workers must agree through the coordination
            service. Defaults to None: one worker.
        model: The Keras model whose `fit` is running. Defaults to None: the handler
            stays until `close()`.
    """

    _runs = 0
    _active: PreemptionWatcher | None = None

    def __init__(self, spec: ClusterSpec | None = None, model=None):
        if PreemptionWatcher._active is not None:  # left behind by a fit that raised
            PreemptionWatcher._active.close()
        PreemptionWatcher._active = self
        self._fit_frame = _find_fit_frame(model) if model is not None else None
        PreemptionWatcher._runs += 1
        self._key = f"tf_distrib/preemption/{PreemptionWatcher._runs}"
        self._tasks = spec.training_tasks if spec is not None else []
        self._me = spec.task if spec is not None else None
        self._multi_worker = len(self._tasks) > 1
        self._signalled = False
        self._announced = False
        self._stop_at: int | None = None
        self._closed = threading.Event()
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._multi_worker:
            threading.Thread(target=self._watch, name="tf_distrib-preemption",
                             daemon=True).start()

    def _on_sigterm(self, signum, frame):
        if self._fit_frame is None or _on_stack(self._fit_frame, frame):
            self._signalled = True
            return
        previous = self._previous
        self.close()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # the default action, now restored

    def _watch(self):
        while not self._closed.is_set():
            try:
                value = _compat.coordination_service().get_config_key_value(self._key, _POLL_MS)
            except tf.errors.DeadlineExceededError:
                continue
            except Exception:  # the cluster is shutting down; nothing left to watch
                return
            self._stop_at = int(value)
            try:
                _compat.coordination_service().set_config_key_value(
                    f"{self._key}/seen/{self._me}", value)
            except Exception:  # the cluster is shutting down; nobody waits for the word
                pass
            return

    def stop_step(self, step: int) -> int | None:
        """The global step at which to save and exit, once a preemption is known.

        Args:
            step: The global step this worker just finished.
        """
        if self._signalled and not self._announced:
            self._announced = True
            if not self._multi_worker:
                self._stop_at = step
            else:
                self._stop_at = self._announce(step + _STOP_MARGIN_STEPS)
        return self._stop_at

    def _announce(self, stop_at: int) -> int:
        """Publishes `stop_at` (unless a peer was first) and returns it once all have read it."""
        service = _compat.coordination_service()
        try:
            service.set_config_key_value(self._key, str(stop_at))
        except tf.errors.AlreadyExistsError:
            pass  # a peer was first: its step holds for everyone
        agreed = int(service.get_config_key_value(self._key, _AGREE_MS))
        deadline = time.monotonic() + _AGREE_MS / 1000
        for task in self._tasks:
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                service.get_config_key_value(f"{self._key}/seen/{task}", left_ms)
            except tf.errors.DeadlineExceededError:
                print(f"tf_distrib: {task} did not read the preemption stop step (step "
                      f"{agreed}) within {_AGREE_MS // 1000} s; saving at it anyway.",
                      file=sys.stderr, flush=True)
        return agreed

    def close(self) -> None:
        """Stops watching and restores the previous SIGTERM handler."""
        if PreemptionWatcher._active is self:
            PreemptionWatcher._active = None
        self._closed.set()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _find_fit_frame(model) -> tuple[int, object] | None:
    """(id, code) of the frame of `model.fit` that is calling us, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            return id(frame), frame.f_code
        frame = frame.f_back
    return None


def _on_stack(fit_frame, frame) -> bool:
    while frame is not None:
        if (id(frame), frame.f_code) == fit_frame:
            return True
        frame = frame.f_back
    return False
