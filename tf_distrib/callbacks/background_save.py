"""One save at a time on a thread of its own, waited for before the process exits."""

from __future__ import annotations

import atexit
import sys
import threading
import time

# How long an exiting process waits for a backup still being written.
EXIT_WAIT_SECONDS = 600.0
# How long it waits before it says so (deleting backups at the end of fit takes ~0.1 s).
_QUIET_EXIT_WAIT_SECONDS = 1.0
THREAD_NAME = "tf_distrib-backup"


class BackgroundSave:
    """Runs backup jobs (mapping memory, writing, deleting) one at a time off the training thread.

    `start` waits for the previous job first (at most one in flight); `wait` returns
    once the current one is done and raises what it raised; `what` describes the job
    last started and `started_at` says when (time.monotonic). An exiting interpreter
    waits for a running job (up to `exit_wait` seconds), so a backup that was started
    is finished unless the process is killed or the storage stalls. A killed write
    leaves a backup without a manifest, which restores skip (with a warning); a killed
    deletion leaves retired backups, which restores do not see and the next deletion
    removes.

    Args:
        exit_wait: The longest an exiting process waits for the running job, in
            seconds. Defaults to `EXIT_WAIT_SECONDS`.
    """

    def __init__(self, exit_wait: float = EXIT_WAIT_SECONDS):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._exit_wait = exit_wait
        self.what = ""
        self.started_at = 0.0
        atexit.register(self._wait_at_exit)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, job, what: str) -> float:
        """Runs `job()` in the background; returns the seconds spent waiting for the last."""
        waited = self.wait()
        self.what, self.started_at = what, time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(job,), daemon=True,
                                        name=THREAD_NAME)
        self._thread.start()
        return waited

    def wait(self, timeout: float | None = None) -> float:
        """Waits for the running job; returns the seconds waited.

        Raises:
            RuntimeError: the job failed (the cause is chained).
            TimeoutError: it still runs after `timeout` seconds.
        """
        start = time.monotonic()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.what} still runs after {timeout:g} s.")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{self.what} failed: {error}") from error
        return time.monotonic() - start

    def _run(self, job) -> None:
        try:
            job()
        except BaseException as e:  # surfaced by the next wait()
            self._error = e

    def _wait_at_exit(self) -> None:
        if self._thread is not None:
            self._thread.join(_QUIET_EXIT_WAIT_SECONDS)
        if not self.busy:
            return
        sys.stderr.write(f"tf_distrib: waiting for {self.what} to finish before exiting\n")
        sys.stderr.flush()
        try:
            self.wait(self._exit_wait)
        except (RuntimeError, TimeoutError) as e:
            sys.stderr.write(f"tf_distrib: {e}\n")
