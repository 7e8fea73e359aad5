"""A group of worker processes: start, log and show their output, stop without orphans."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

from tf_distrib.launch import forkserver
from tf_distrib.launch.console import Console

# Lines kept per worker for error messages and results.
TAIL_LINES = 2000


class WorkerProcess:
    """One worker: its process, its log file, a tail of its output and how it ended."""

    def __init__(self, index: int, argv: Sequence[str], env: dict, console: Console,
                 log_path: str, preload: bool = False):
        self.index, self.log_path = index, log_path
        self.output: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._console = console
        # A session of its own, so that stopping it also stops whatever it started.
        self.process = forkserver.spawn(argv, env) if preload else subprocess.Popen(
            list(argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        self._log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (closed by its pumps)
        self._log_lock = threading.Lock()
        self._open_pipes = 2
        self._readers = [threading.Thread(target=self._pump, args=(pipe, name), daemon=True)
                         for pipe, name in ((self.process.stdout, "stdout"),
                                            (self.process.stderr, "stderr"))]
        for reader in self._readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def _pump(self, pipe, stream: str) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            if not line.endswith("\n"):
                line += "\n"
            self.output.append(line)
            with self._log_lock:
                self._log.write(line)
                self._log.flush()
            self._console.write(self.index, stream, line)
        pipe.close()
        with self._log_lock:
            self._open_pipes -= 1
            if not self._open_pipes:
                self._log.close()

    def signal(self, signum: int) -> None:
        if self.returncode is not None:
            return
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def finish_output(self, timeout: float = 5.0) -> None:
        """Waits until everything the worker printed has been streamed."""
        for reader in self._readers:
            reader.join(timeout)


class ProcessGroup:
    """Starts one process per (argv, env) pair and stops them together.

    Args:
        commands: One (argv, env) pair per worker.
        console: Shows the workers' lines (`tf_distrib.launch.console`); worker i of
            `commands` writes to it as worker i.
        log_paths: One file per worker that gets its complete output (stdout and
            stderr in arrival order).
        preload: Fork the workers from a process that has imported TensorFlow and
            Keras (`tf_distrib.launch.forkserver`). Defaults to False.
    """

    def __init__(self, commands, console: Console, log_paths: Sequence[str],
                 preload: bool = False):
        self.console = console
        self.workers: list[WorkerProcess] = []
        try:
            for index, ((argv, env), path) in enumerate(zip(commands, log_paths, strict=True)):
                self.workers.append(WorkerProcess(index, argv, env, console, path, preload))
        except BaseException:
            self.stop(grace_period=0)
            raise

    def returncodes(self) -> list[int | None]:
        """Each worker's exit status, None while it runs."""
        return [w.returncode for w in self.workers]

    def stop(self, grace_period: float) -> None:
        """SIGTERM every live worker, then SIGKILL those still alive after `grace_period`.

        MultiWorkerMirroredStrategy installs a SIGTERM handler and keeps training, so
        the SIGKILL is what actually ends such workers.
        """
        for worker in self.workers:
            worker.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_period
        while time.monotonic() < deadline and any(c is None for c in self.returncodes()):
            time.sleep(0.05)
        for worker in self.workers:
            if worker.returncode is None:
                worker.signal(signal.SIGKILL)
            else:
                # The leader may be gone while helpers it started still run.
                _kill_session(worker.pid)
        for worker in self.workers:
            worker.process.wait()
            worker.finish_output()
        self.console.close()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
