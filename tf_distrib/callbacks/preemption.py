"""Agree on one step at which every worker saves after a SIGTERM (preemption).

SIGTERM reaches one worker, while every worker must save at the same step (saving
takes part in collectives). The first worker that sees the signal publishes a stop
step a little ahead of its own in the coordination service's key-value store; every
worker watches that key from a thread and stops at that step. Synchronous workers
are never more than one step apart, so a margin of two steps is always ahead of
all of them. No collective runs per step.
"""

from __future__ import annotations

import signal
import threading

import tensorflow as tf
from tensorflow.python.eager import context

_STOP_MARGIN_STEPS = 2
_POLL_MS = 1000


class PreemptionWatcher:
    """Tells, at each step, whether this worker must save and exit now.

    Installs a SIGTERM handler (main thread only) until `close()`.

    Args:
        multi_worker: Whether peers must agree through the coordination service.
    """

    _runs = 0

    def __init__(self, multi_worker: bool):
        PreemptionWatcher._runs += 1
        self._key = f"tf_distrib/preemption/{PreemptionWatcher._runs}"
        self._multi_worker = multi_worker
        self._signalled = False
        self._announced = False
        self._stop_at: int | None = None
        self._closed = threading.Event()
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if multi_worker:
            threading.Thread(target=self._watch, name="tf_distrib-preemption",
                             daemon=True).start()

    def _on_sigterm(self, signum, frame):
        self._signalled = True

    def _watch(self):
        while not self._closed.is_set():
            try:
                value = context.context().get_config_key_value(self._key, _POLL_MS)
            except tf.errors.DeadlineExceededError:
                continue
            except Exception:  # the cluster is shutting down; nothing left to watch
                return
            self._stop_at = int(value)
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
                try:
                    context.context().set_config_key_value(
                        self._key, str(step + _STOP_MARGIN_STEPS))
                except tf.errors.AlreadyExistsError:
                    pass  # a peer was first: its step holds for everyone
                self._stop_at = int(context.context().get_config_key_value(self._key, 60_000))
        return self._stop_at

    def close(self) -> None:
        """Stops watching and restores the previous SIGTERM handler."""
        self._closed.set()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
