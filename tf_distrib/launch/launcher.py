"""`launch()`: run a training target on N local workers with TF_CONFIG, restart on failure."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tf_distrib import cluster as cluster_lib
from tf_distrib._checks import check_int, is_int
from tf_distrib.contract import (
    ENV_ATTEMPT,
    ENV_MAX_RESTARTS,
    ENV_NUM_WORKERS,
    ENV_STARTUP_TIMEOUT,
    ENV_WORKER_INDEX,
    PREEMPTED_EXIT_CODE,
)
from tf_distrib.launch import targets
from tf_distrib.launch.errors import LaunchError
from tf_distrib.launch.job import DEFAULTS
from tf_distrib.launch.process_group import ProcessGroup

_POLL_SECONDS = 0.1


@dataclasses.dataclass
class WorkerResult:
    """How one worker of one attempt ended.

    Attributes:
        index: The worker's index (its TF_CONFIG task index).
        pid: Its process id (it led a process session of its own).
        exit_code: Its exit status; negative when a signal ended it (-9: SIGKILL).
        output: The last lines it printed (stdout and stderr, in arrival order).
        value: What a function target returned; None for scripts.
    """

    index: int
    pid: int
    exit_code: int
    output: list[str]
    value: Any = None

    @property
    def status(self) -> str:
        """The exit status in words, e.g. "exit status 3" or "signal SIGKILL"."""
        return _status(self.exit_code)


@dataclasses.dataclass
class Attempt:
    """One start of the whole worker group.

    Attributes:
        number: 0 for the first start, 1 for the first restart, ...
        workers: One result per worker.
        failure: Why the attempt failed, or None when every worker exited with 0.
        failed_worker: Index of the worker that failed first, or None.
    """

    number: int
    workers: list[WorkerResult]
    failure: str | None = None
    failed_worker: int | None = None


@dataclasses.dataclass
class LaunchResult:
    """The outcome of `launch()`.

    Attributes:
        exit_code: 0 when the last attempt succeeded; otherwise the failed worker's
            exit status (128 + signal number for signals), or 128 + N when the
            launcher itself got signal N.
        attempts: Every attempt, in order.
    """

    exit_code: int
    attempts: list[Attempt]

    @property
    def restarts(self) -> int:
        """How many times the group was restarted."""
        return len(self.attempts) - 1

    @property
    def workers(self) -> list[WorkerResult]:
        """The workers of the last attempt."""
        return self.attempts[-1].workers

    @property
    def values(self) -> list[Any]:
        """What a function target returned on each worker in the last attempt."""
        return [w.value for w in self.workers]

    @property
    def exit_codes(self) -> list[list[int]]:
        """Per attempt, each worker's exit code."""
        return [[w.exit_code for w in a.workers] for a in self.attempts]

    def failure_report(self, lines: int = 20) -> str:
        """A message naming the first failed worker, how it failed and its last lines."""
        attempt = self.attempts[-1]
        if attempt.failure is None:
            return "all workers exited with status 0"
        report = f"attempt {attempt.number}: {attempt.failure}"
        if attempt.failed_worker is not None:
            tail = attempt.workers[attempt.failed_worker].output[-lines:]
            report += (f"\nlast {len(tail)} line(s) of worker {attempt.failed_worker}:\n"
                       + "".join(f"    {line}" for line in tail))
        return report


def launch(target: str | Sequence[str] | Callable, num_workers: int, *,
           args: Sequence = (), kwargs: Mapping | None = None,
           max_restarts: int = DEFAULTS.max_restarts,
           startup_timeout: float | None = DEFAULTS.startup_timeout,
           grace_period: float = DEFAULTS.grace_period, timeout: float | None = DEFAULTS.timeout,
           env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
           hosts: Sequence[str] | None = None, host_index: int = DEFAULTS.host_index,
           base_port: int = DEFAULTS.base_port, quiet: bool = False) -> LaunchResult:
    """Runs `target` on `num_workers` worker processes with TF_CONFIG; restarts on failure.

    Each worker gets its TF_CONFIG on fresh free ports (per attempt) and the variables
    TF_DISTRIB_WORKER_INDEX, TF_DISTRIB_NUM_WORKERS, TF_DISTRIB_ATTEMPT,
    TF_DISTRIB_MAX_RESTARTS and TF_DISTRIB_STARTUP_TIMEOUT. Output is streamed line by
    line with a "[worker i] " prefix. When a worker exits non-zero, the whole group is
    stopped (SIGTERM, then SIGKILL after `grace_period`) and started again while
    restarts remain.

    TensorFlow's gRPC servers have no authentication: by default every worker binds
    to 127.0.0.1, reachable from this machine only.

    Args:
        target: A script path, "-m pkg.module", or a Python function (pickled with
            cloudpickle, so notebook functions work; its return value comes back in
            `LaunchResult.values`).
        num_workers: Workers per host, >= 1.
        args: Script arguments, or the function's positional arguments. Defaults to ().
        kwargs: The function's keyword arguments. Defaults to None.
        max_restarts: How many times to restart the group after a failure. Defaults to 0.
        startup_timeout: Seconds a worker may take to start its TensorFlow server
            (listen on its TF_CONFIG port) unless it exits first; a worker that does
            not counts as failed. None disables the check (for targets that never
            start TensorFlow's server). Defaults to 300.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping. Defaults to 5.
        timeout: Seconds the whole launch may run before it is stopped and failed.
            Defaults to None (no limit).
        env: Extra environment variables for the workers. Defaults to None.
        host: The address local workers bind to. Defaults to "127.0.0.1".
        hosts: For a static multi-host launch, every host as "host" or "host:port", in
            the same order on each host; this host runs workers host_index * num_workers
            onwards, on ports port, port + 1, ... (port defaults to `base_port`).
            Defaults to None (single host, free ports).
        host_index: This host's position in `hosts`. Defaults to 0.
        base_port: First port of each host in a multi-host launch. Defaults to 29400.
        quiet: Keep workers' output only in the results instead of streaming it to
            this process's stdout/stderr. Defaults to False.

    Returns:
        A `LaunchResult`.

    Raises:
        LaunchError: for bad input; nothing is started then.

    Example:

    ```python
    def train():
        import tf_distrib as td
        strategy = td.make_strategy()
        ...
        return history.history["loss"][-1]

    result = td.launch.launch(train, num_workers=2, max_restarts=1)
    print(result.exit_code, result.restarts, result.values)
    ```
    """
    _check_launch_args(num_workers, max_restarts, startup_timeout, grace_period, timeout,
                       hosts, host_index, base_port)
    stdout, stderr = (None, None) if quiet else (sys.stdout, sys.stderr)
    with tempfile.TemporaryDirectory(prefix="tf_distrib_launch_") as workdir:
        attempts: list[Attempt] = []
        with _StopSignals() as stop:
            group = _Group(
                target=targets.resolve(target, args, kwargs, workdir), workdir=workdir,
                num_workers=num_workers, max_restarts=max_restarts,
                startup_timeout=startup_timeout, grace_period=grace_period,
                deadline=None if timeout is None else time.monotonic() + timeout,
                env=dict(env or {}), host=host, hosts=hosts, host_index=host_index,
                base_port=base_port, stop=stop, stdout=stdout, stderr=stderr)
            for number in range(max_restarts + 1):
                attempt = _run_attempt(group, number)
                attempts.append(attempt)
                if attempt.failure is None:
                    return LaunchResult(0, attempts)
                if stop.signum is not None:
                    return LaunchResult(128 + stop.signum, attempts)
                if group.deadline is not None and time.monotonic() >= group.deadline:
                    break
                if number < max_restarts and stderr is not None:
                    stderr.write(f"[launcher] attempt {number} failed: {attempt.failure}; "
                                 f"restarting ({number + 1}/{max_restarts})\n")
        return LaunchResult(_exit_code_of(attempts[-1]), attempts)


def _check_launch_args(num_workers, max_restarts, startup_timeout, grace_period, timeout,
                       hosts, host_index, base_port):
    try:
        check_int("num_workers", num_workers)
        check_int("max_restarts", max_restarts, minimum=0)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    for name, value in (("startup_timeout", startup_timeout), ("timeout", timeout)):
        if value is not None and not value > 0:
            raise LaunchError(f"{name} must be > 0 seconds or None, got {value!r}.")
    if not grace_period >= 0:
        raise LaunchError(f"grace_period must be >= 0 seconds, got {grace_period!r}.")
    if hosts is not None:
        if not hosts or not all(isinstance(h, str) and h for h in hosts):
            raise LaunchError(f"hosts must be a non-empty list of addresses, got {hosts!r}.")
        if not is_int(host_index) or not 0 <= host_index < len(hosts):
            raise LaunchError(f"host_index must be in 0..{len(hosts) - 1}, got {host_index!r}.")
        if not is_int(base_port) or not 1 <= base_port <= 65535 - num_workers:
            raise LaunchError(f"base_port {base_port!r} leaves no room for {num_workers} "
                              "ports below 65536.")


@dataclasses.dataclass(frozen=True)
class _Group:
    """What every attempt of one launch shares."""

    target: targets.Target
    workdir: str
    num_workers: int
    max_restarts: int
    startup_timeout: float | None
    grace_period: float
    deadline: float | None
    env: dict
    host: str
    hosts: Sequence[str] | None
    host_index: int
    base_port: int
    stop: _StopSignals
    stdout: object
    stderr: object


def _tf_configs(group: _Group) -> tuple[list[dict], int]:
    """The TF_CONFIGs of this host's workers and the global index of the first."""
    n = group.num_workers
    if group.hosts is None:
        return cluster_lib.local_tf_configs(n, group.host), 0
    addresses = []
    for entry in group.hosts:
        name, port = _split_host(entry, group.base_port)
        addresses += [f"{name}:{port + i}" for i in range(n)]
    first = group.host_index * n
    configs = [{"cluster": {"worker": addresses}, "task": {"type": "worker", "index": first + i}}
               for i in range(n)]
    for config in configs:
        cluster_lib.parse_tf_config(config)
    return configs, first


def _split_host(entry: str, base_port: int) -> tuple[str, int]:
    """"host" -> (host, base_port); "host:port" or "[v6]:port" -> (host, port)."""
    name, sep, port = entry.rpartition(":")
    if sep and port.isdigit() and (not name.count(":") or name.endswith("]")):
        return name, int(port)
    return entry, base_port


def _run_attempt(group: _Group, number: int) -> Attempt:
    configs, first = _tf_configs(group)
    num_workers = len(configs)
    total = num_workers * (len(group.hosts) if group.hosts else 1)
    commands, result_paths = [], []
    for i, config in enumerate(configs):
        worker_env = {**os.environ, **group.env}
        worker_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        worker_env.update({
            "TF_CONFIG": json.dumps(config),
            ENV_WORKER_INDEX: str(first + i),
            ENV_NUM_WORKERS: str(total),
            ENV_ATTEMPT: str(number),
            ENV_MAX_RESTARTS: str(group.max_restarts),
            "PYTHONUNBUFFERED": "1",
        })
        if group.startup_timeout is not None:
            worker_env[ENV_STARTUP_TIMEOUT] = str(group.startup_timeout)
        path = os.path.join(group.workdir, f"result-{number}-{i}.pkl")
        result_paths.append(path)
        commands.append((group.target.command(path), worker_env))
    ports = [int(c["cluster"]["worker"][c["task"]["index"]].rpartition(":")[2]) for c in configs]

    prefixes = [f"[worker {first + i}] " for i in range(num_workers)]
    processes = ProcessGroup(commands, prefixes, stdout=group.stdout, stderr=group.stderr)
    failure = failed = None
    started = time.monotonic()
    joined = [False] * num_workers
    while failure is None:
        codes = processes.returncodes()
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            failed = bad[0]
            failure = f"worker {first + failed} failed with " + _status(codes[failed])
        elif all(c == 0 for c in codes):
            break
        elif group.stop.signum is not None:
            failure = f"launcher received {signal.Signals(group.stop.signum).name}"
        elif group.deadline is not None and time.monotonic() >= group.deadline:
            failure = "the launch timed out"
        elif group.startup_timeout is not None and not all(joined):
            for i in range(num_workers):
                joined[i] = (joined[i] or codes[i] is not None or cluster_lib.is_listening(
                    f"{group.host}:{ports[i]}", timeout=0.2))
            if not all(joined) and time.monotonic() - started > group.startup_timeout:
                failed = joined.index(False)
                failure = (f"worker {first + failed} did not start TensorFlow's server on "
                           f"port {ports[failed]} within "
                           f"startup_timeout={group.startup_timeout:g} s")
        if failure is None:
            time.sleep(_POLL_SECONDS)
    if failed is not None and processes.returncodes()[failed] == PREEMPTED_EXIT_CODE:
        # Peers save at the same step and exit on their own: give them the grace period.
        deadline = time.monotonic() + group.grace_period
        while any(c is None for c in processes.returncodes()) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
    processes.stop(group.grace_period)
    workers = [_worker_result(i, w, result_paths[i], group.target)
               for i, w in enumerate(processes.workers)]
    return Attempt(number, workers, failure, failed)


def _worker_result(index, worker, result_path, resolved) -> WorkerResult:
    value = targets.read_result(result_path) if resolved.is_function else None
    return WorkerResult(index, worker.pid, worker.returncode, list(worker.output), value)


def _status(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit status {code}"


def _exit_code_of(attempt: Attempt) -> int:
    if attempt.failed_worker is None:
        return 1
    code = attempt.workers[attempt.failed_worker].exit_code
    return 128 - code if code < 0 else code or 1


class _StopSignals:
    """Turns SIGINT/SIGTERM into a flag while the launch runs (main thread only)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
