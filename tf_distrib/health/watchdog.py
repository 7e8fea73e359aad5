"""Hang watchdog and flight recorder for multi-worker training.

A worker that is alive but stuck leaves its peers waiting in a collective; TensorFlow's
heartbeat catches only dead processes. Each step a `make_strategy()` MWMS worker runs
counts itself from inside the step's graph, and the `Watchdog`'s thread reads the count
once a second. When no step has finished for `hang_timeout` seconds, the worker writes a
flight-recorder report (its last steps, its transport's last collectives, every
thread's stack), tells its peers to write theirs, and exits with `HUNG_EXIT_CODE` (76);
`tf-distrib launch` names who stopped first and restarts the group.

It arms after the first step, fires only inside `fit`, `evaluate`, `predict` or a
tf.function, and pauses while `BackupAndRestore` saves; wrap other long work inside
training in `tf_distrib.health.watchdog.paused("exporting")`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from tf_distrib import contract
from tf_distrib.health import failure_report, phases

#: Seconds without a finished step before the watchdog fires, unless told otherwise.
DEFAULT_HANG_TIMEOUT = 600.0
# Steps the flight recorder remembers.
RECORDED_STEPS = 32
# Seconds between reads of the step count until the first step finishes.
_FIRST_STEP_POLL = 0.05

_active: Watchdog | None = None
# A frame of TensorFlow running a tf.function (Keras' train, test and predict steps).
_STEP_FRAME = "tensorflow/python/eager/polymorphic_function/"
# Keras' training loops (fit, evaluate, predict) and the callbacks they call.
_KERAS_LOOP = "keras/src/backend/tensorflow/trainer.py"


class Watchdog:
    """Stops this worker, with a report, when no step finishes for `timeout` seconds.

    Args:
        task: This worker's task, e.g. "worker:1".
        timeout: Seconds without a finished step (after the first one).
        progress: Returns how many steps have finished so far.
        transport: The worker's `tf_distrib.transport.Transport` (or anything with its
            `mode`, `recent()` and `waiting_for()`), for the report. Defaults to None.
        report_dir: Where to write the report. Defaults to None: the launcher's
            TF_DISTRIB_REPORT_DIR, else nowhere (the summary goes to stderr anyway).
        key: The coordination-service key through which workers tell each other
            that one fired. Defaults to None: no peers to tell.
        exit: Called with the exit status once the report is written. Defaults to
            `os._exit` (the process is stuck; nothing else would end it).

    Example:

    ```python
    strategy = td.make_strategy(hang_timeout=300)   # starts one per MWMS worker
    print(strategy.watchdog)
    ```
    """

    def __init__(self, task: str, timeout: float, progress: Callable[[], int], *,
                 transport: failure_report.CollectiveState | None = None,
                 report_dir: str | None = None, key: str | None = None,
                 exit: Callable[[int], object] = os._exit):
        global _active
        self.task, self.timeout, self.transport, self.key = task, timeout, transport, key
        self._progress = progress
        self.report_dir = report_dir
        self.steps = 0
        self.last_step_at: float | None = None
        self.report: dict | None = None
        self._recent: collections.deque = collections.deque(maxlen=RECORDED_STEPS)
        self._pauses: list[str] = []
        self._exit = exit
        self._stopped = threading.Event()
        _active = self
        threading.Thread(target=self._watch, name="tf_distrib-watchdog", daemon=True).start()

    def _observe(self) -> None:
        steps = self._progress()
        if steps != self.steps:
            if not self.steps:
                phases.enter(phases.TRAINING)
            self.steps, self.last_step_at = steps, time.time()
            self._recent.append((steps, self.last_step_at))

    @contextlib.contextmanager
    def paused(self, reason: str):
        """No step needs to finish while inside (a long save, an export)."""
        self._pauses.append(reason)
        try:
            yield
        finally:
            self._pauses.remove(reason)
            self.last_step_at = time.time() if self.last_step_at is not None else None

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout / 10)
        # Until the first step finishes, often: the launcher names the phase a stopped
        # worker is in from what this thread reports (`tf_distrib.health.phases`).
        wait = _FIRST_STEP_POLL
        while not self._stopped.wait(wait):
            self._observe()
            wait = interval if self.steps else _FIRST_STEP_POLL
            told = self._told_by_peer(wait)
            if told is not None:
                self._fire(f"{told} reported a hang")
                return
            if (self.last_step_at is not None and not self._pauses
                    and time.time() - self.last_step_at > self.timeout):
                if not _training():
                    # Between fits (the script saves, exports, evaluates by hand): wait
                    # for the next step instead.
                    self.last_step_at = None
                    continue
                self._fire(f"no step finished for {self.timeout:g} s")
                return

    def _told_by_peer(self, wait: float) -> str | None:
        if self.key is None:
            return None
        from tf_distrib import _compat

        try:
            return json.loads(_compat.coordination_service().get_config_key_value(
                self.key, max(1, int(wait * 1000))))["task"]
        except Exception:  # no such key yet, or the coordination service is gone
            return None

    def _fire(self, cause: str) -> None:
        self.report = self._report(cause)
        path = failure_report.write(self.report, self.report_dir)
        last = "none"
        if self.last_step_at is not None:
            clock = time.strftime("%H:%M:%S", time.localtime(self.last_step_at))
            last = f"step {self.steps} at {clock}"
        main = self.report["stacks"].get("MainThread", [])
        # Without a launcher to read the reports (srun, TFJob), the peers this worker
        # waits for are the best evidence of who is stuck.
        waiting = (self.report["transport"] or {}).get("waiting_for")
        sys.stderr.write(
            f"tf_distrib watchdog: {self.task}: {cause} (last finished step: {last}"
            + (f"; waiting for {', '.join(waiting)}" if waiting else "") + "); "
            f"exiting with status {contract.HUNG_EXIT_CODE}."
            + (f" Flight recorder: {path}." if path else "") + "\n"
            + "".join(f"    {line}" for line in main[-6:]))
        sys.stderr.flush()
        self._tell_peers()
        self._exit(contract.HUNG_EXIT_CODE)

    def _tell_peers(self) -> None:
        """Publishes the hang, then gives the peers a moment to write their reports."""
        if self.key is None:
            return
        from tf_distrib import _compat

        with contextlib.suppress(Exception):  # a peer told us first, or the service is gone
            _compat.coordination_service().set_config_key_value(
                self.key, json.dumps({"task": self.task, "step": self.steps}))
        time.sleep(3.0)

    def _report(self, cause: str) -> dict:
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = {names.get(ident, str(ident)): traceback.format_stack(frame)
                  for ident, frame in sys._current_frames().items()}
        transport = failure_report.transport_state(self.transport)
        main = stacks.get("MainThread", [])
        return {"task": self.task, "pid": os.getpid(), "cause": cause, "fired_at": time.time(),
                "hang_timeout": self.timeout, "steps": self.steps,
                "last_step_at": self.last_step_at, "recent_steps": list(self._recent),
                "paused": list(self._pauses), "transport": transport,
                # Inside a step, a worker waits (for its input or its peers); outside
                # one, its own Python code (a callback, the training loop) holds it.
                "in_step": any(_STEP_FRAME in line for line in main), "stacks": stacks}


def _training() -> bool:
    """Whether the main thread is in Keras' fit/evaluate/predict or in a tf.function."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if _STEP_FRAME in frame.f_code.co_filename or _KERAS_LOOP in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def paused(reason: str):
    """Pauses this process's watchdog (if any) while inside: for long work between steps.

    Example:

    ```python
    with tf_distrib.health.watchdog.paused("exporting the model"):
        if td.callbacks.is_chief():
            model.export("/shared/model")
    ```
    """
    if _active is None:
        yield
    else:
        with _active.paused(reason):
            yield
