"""`launch()`: run a training target on N workers with TF_CONFIG, restart on failure."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
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
    ENV_HANG_TIMEOUT,
    ENV_MAX_RESTARTS,
    ENV_NUM_WORKERS,
    ENV_REPORT_DIR,
    ENV_SECRET,
    ENV_STARTUP_TIMEOUT,
    ENV_WORKER_INDEX,
    EXIT_CODES,
    HUNG_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
)
from tf_distrib.launch import console as console_lib
from tf_distrib.launch import forkserver, membership, reports, targets
from tf_distrib.launch import rendezvous as rendezvous_lib
from tf_distrib.launch.errors import LaunchError
from tf_distrib.launch.job import DEFAULTS
from tf_distrib.launch.liveness import Liveness
from tf_distrib.launch.process_group import ProcessGroup

_POLL_SECONDS = 0.1
# Exit statuses after which the other workers stop on their own, and how long they may take.
_PEERS_FOLLOW = (PREEMPTED_EXIT_CODE, HUNG_EXIT_CODE)
_PEERS_FOLLOW_SECONDS = 15.0
# Lines of the failed worker's output in the root-cause block.
_ROOT_CAUSE_LINES = 5


@dataclasses.dataclass
class WorkerResult:
    """How one worker of one attempt ended.

    Attributes:
        index: The worker's index (its TF_CONFIG task index).
        pid: Its process id (it led a process session of its own).
        exit_code: Its exit status; negative when a signal ended it (-9: SIGKILL).
        output: The last lines it printed (stdout and stderr, in arrival order).
        value: What a function target returned; None for scripts.
        log_path: The file with everything it printed. Defaults to None.
    """

    index: int
    pid: int
    exit_code: int
    output: list[str]
    value: Any = None
    log_path: str | None = None

    @property
    def status(self) -> str:
        """The exit status in words, e.g. "exit status 3" or "signal SIGKILL"."""
        return _status(self.exit_code)


@dataclasses.dataclass
class Attempt:
    """One start of the whole worker group.

    Attributes:
        number: 0 for the first start, 1 for the first restart, ...
        workers: One result per worker (of this host).
        failure: Why the attempt failed, or None when every worker exited with 0.
        failed_worker: Index (in `workers`) of the worker that failed first, or None.
        stopped_first: The workers (indices in `workers`) whose progress stopped first,
            named by the workers' flight-recorder reports (hangs, lost peers).
        members: The worker slots (one host) or hosts (`hosts`) this attempt ran.
        planned: The launcher stopped the attempt itself, so that dropped slots or
            late hosts could rejoin (an elastic launch growing back).
        seconds: How long the attempt ran, from start to the last worker's exit.
    """

    number: int
    workers: list[WorkerResult]
    failure: str | None = None
    failed_worker: int | None = None
    stopped_first: list[int] = dataclasses.field(default_factory=list)
    members: list[int] = dataclasses.field(default_factory=list)
    planned: bool = False
    seconds: float = 0.0


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
        """How many times the group was restarted after a failure (not to grow back)."""
        return sum(1 for a in self.attempts[:-1] if not a.planned)

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
           min_workers: int | None = None,
           max_restarts: int = DEFAULTS.max_restarts,
           startup_timeout: float | None = DEFAULTS.startup_timeout,
           hang_timeout: float | None = DEFAULTS.hang_timeout,
           grace_period: float = DEFAULTS.grace_period, timeout: float | None = DEFAULTS.timeout,
           env: Mapping[str, str] | None = None, host: str = "127.0.0.1",
           hosts: Sequence[str] | None = None, host_index: int = DEFAULTS.host_index,
           base_port: int = DEFAULTS.base_port, min_hosts: int | None = None,
           rendezvous_timeout: float = DEFAULTS.rendezvous_timeout,
           slot_failures: int = DEFAULTS.slot_failures,
           rejoin_interval: float = DEFAULTS.rejoin_interval,
           log_dir: str | None = DEFAULTS.log_dir, verbose: bool = DEFAULTS.verbose,
           preload: bool | None = DEFAULTS.preload, quiet: bool = False) -> LaunchResult:
    """Runs `target` on `num_workers` worker processes with TF_CONFIG; restarts on failure.

    Each worker gets its TF_CONFIG on fresh free ports (per attempt) and the variables of
    `tf_distrib.contract`: TF_DISTRIB_WORKER_INDEX, TF_DISTRIB_NUM_WORKERS,
    TF_DISTRIB_ATTEMPT, TF_DISTRIB_MAX_RESTARTS, TF_DISTRIB_STARTUP_TIMEOUT,
    TF_DISTRIB_HANG_TIMEOUT, TF_DISTRIB_SECRET (a new random secret per launch, for the
    gradient transport's connections) and TF_DISTRIB_REPORT_DIR. Each worker's complete
    output goes to `log_dir`/attempt-N/worker-I.log; the console shows it condensed,
    line by line with a "[worker i] " prefix (`tf_distrib.launch.console`), and a
    failed attempt ends with a root-cause block. When a worker exits non-zero, the whole
    group is stopped (SIGTERM, then SIGKILL after `grace_period`) and started again
    while restarts remain; the workers' flight-recorder reports name the ones that
    stopped first (`Attempt.stopped_first`). A worker whose process stays stopped
    (SIGSTOP, a paused container) for 5 s fails the attempt in any phase, named with
    the phase (`tf_distrib.launch.liveness`).

    Elastic launches (`min_workers`, or `min_hosts` with `hosts`) go on with fewer
    workers when some cannot: see `tf_distrib.launch.membership` and
    `tf_distrib.launch.rendezvous`. `BackupAndRestore` and `distribute_dataset` resume
    exactly across the change of size, with the same global batch.

    TensorFlow's gRPC servers have no authentication: by default every worker binds
    to 127.0.0.1, reachable from this machine only.

    Args:
        target: A script path, "-m pkg.module", or a Python function (pickled with
            cloudpickle, so notebook functions work; its return value comes back in
            `LaunchResult.values`).
        num_workers: Workers per host (the most, for an elastic launch), >= 1.
        args: Script arguments, or the function's positional arguments. Defaults to ().
        kwargs: The function's keyword arguments. Defaults to None.
        min_workers: The fewest workers an attempt on this host may run: a worker slot
            that fails `slot_failures` attempts in a row is dropped while at least this
            many remain. Defaults to None: `num_workers` (not elastic).
        max_restarts: How many times to restart the group after a failure. Defaults to 0.
        startup_timeout: Seconds a worker may take from its start to its first
            training step (the phases it reports, `tf_distrib.phases`; a target that
            does not use `make_strategy` only has to start TensorFlow's server on its
            TF_CONFIG port) unless it exits first; the worker furthest behind counts
            as failed, named with its phase. None disables the check (for targets that
            never start TensorFlow's server). Defaults to 300.
        hang_timeout: Seconds without a finished step after which workers' watchdogs
            stop them (TF_DISTRIB_HANG_TIMEOUT). Defaults to None: the strategy's
            default, 600.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping. Defaults to 5.
        timeout: Seconds the whole launch may run before it is stopped and failed.
            Defaults to None (no limit).
        env: Extra environment variables for the workers. Defaults to None.
        host: The address local workers bind to. Defaults to "127.0.0.1".
        hosts: For a static multi-host launch, every host as "host" or "host:port", in
            the same order on each host; each member host runs `num_workers` workers
            on ports port, port + 1, ... (port defaults to `base_port`). Defaults to
            None (single host, free ports).
        host_index: This host's position in `hosts`. Defaults to 0.
        base_port: First port of each host in a multi-host launch. Defaults to 29400.
        min_hosts: With `hosts`, the fewest hosts an attempt may start with: host 0's
            launcher runs a rendezvous on host 0's first port minus one, and hosts
            that have not joined within `rendezvous_timeout` are left out of the
            attempt. Defaults to None: every host, no rendezvous.
        rendezvous_timeout: Seconds an elastic multi-host attempt waits for missing
            hosts. Defaults to 60.
        slot_failures: Failed attempts in a row that drop a worker slot (elastic
            launches). Defaults to 2.
        rejoin_interval: Seconds before a dropped slot is tried again; a smaller group
            that runs this long is stopped as on preemption so that it can grow back.
            Defaults to 600.
        log_dir: Where every worker's complete output goes, one file per worker and
            attempt. Defaults to None: a new directory under the system's temporary
            directory, printed at the start.
        verbose: Show every line of every worker on the console, TensorFlow's
            start-up notices and repeated lines included. Defaults to False (or
            TF_DISTRIB_VERBOSE=1).
        preload: Fork every worker, on every attempt, from a process that has already
            imported TensorFlow and Keras instead of starting a fresh interpreter
            (`tf_distrib.launch.forkserver`): workers and restarts start seconds
            sooner. Not for targets that set environment variables themselves before
            they import TensorFlow (those the launch passes in `env` are fine).
            Linux only. Defaults to None: TF_DISTRIB_PRELOAD=1 turns it on.
        quiet: Keep workers' output only in the results and log files instead of
            streaming it to this process's stdout/stderr. Defaults to False.

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
    min_workers = num_workers if min_workers is None else min_workers
    min_hosts = (len(hosts) if hosts else 1) if min_hosts is None else min_hosts
    _check_launch_args(num_workers, min_workers, max_restarts, startup_timeout, hang_timeout,
                       grace_period, timeout, hosts, host_index, base_port, min_hosts,
                       slot_failures)
    stdout, stderr = (None, None) if quiet else (sys.stdout, sys.stderr)
    verbose = verbose or os.environ.get(console_lib.ENV_VERBOSE) == "1"
    preload = forkserver.enabled(preload)
    if preload:
        forkserver.check_supported()
    log_dir = log_dir or tempfile.mkdtemp(prefix=time.strftime("tf_distrib_logs_%Y%m%d-%H%M%S_"))
    os.makedirs(log_dir, exist_ok=True)
    _say(stderr, f"every worker's full output: {log_dir}"
         + ("" if verbose else " (TensorFlow's start-up notices and repeated lines are "
                               "condensed here; --verbose shows all)"))
    with tempfile.TemporaryDirectory(prefix="tf_distrib_launch_") as workdir:
        reports_dir = os.path.join(workdir, "reports")
        os.makedirs(reports_dir)
        worker_env = {ENV_REPORT_DIR: reports_dir, **dict(env or {})}
        if hang_timeout is not None:
            worker_env[ENV_HANG_TIMEOUT] = str(hang_timeout)
        if ENV_SECRET not in os.environ and ENV_SECRET not in worker_env and not hosts:
            worker_env[ENV_SECRET] = secrets.token_hex(32)
        with _StopSignals() as stop, _Rendezvous(hosts, host_index, base_port, min_hosts,
                                                 rendezvous_timeout) as rendezvous:
            group = _Group(
                target=targets.resolve(target, args, kwargs, workdir), workdir=workdir,
                reports_dir=reports_dir, num_workers=num_workers,
                max_restarts=max_restarts, startup_timeout=startup_timeout,
                hang_timeout=hang_timeout, grace_period=grace_period,
                deadline=None if timeout is None else time.monotonic() + timeout,
                env=worker_env, host=host, hosts=hosts, host_index=host_index,
                base_port=base_port, stop=stop, stdout=stdout, stderr=stderr, log_dir=log_dir,
                verbose=verbose, preload=preload)
            slots = membership.Slots(num_workers, min_workers, slot_failures, rejoin_interval)
            return _attempts(group, slots, rendezvous, stderr)


def _attempts(group: _Group, slots: membership.Slots, rendezvous: _Rendezvous,
              stderr) -> LaunchResult:
    """Runs attempts until one succeeds, restarts run out, or the launch is stopped."""
    attempts: list[Attempt] = []
    restarts = 0
    while True:
        if rendezvous.active:
            round_number, members = rendezvous.join()
            if round_number < 0:  # the job finished while this host waited
                return LaunchResult(0, attempts)
            regrow = rendezvous.regrow_check(round_number)
            left_out = [group.hosts[h] for h in range(len(group.hosts)) if h not in members]
            if left_out:
                _say(stderr, f"attempt {len(attempts)} runs on {len(members)} of "
                             f"{len(group.hosts)} hosts; left out (not joined within the "
                             f"rendezvous timeout): {', '.join(left_out)}")
        elif group.hosts:
            members, regrow = list(range(len(group.hosts))), None
        else:
            members = slots.active()
            rejoin_at = slots.rejoin_at()
            regrow = None if rejoin_at is None else (lambda t=rejoin_at: time.monotonic() >= t)
        attempt = _run_attempt(group, len(attempts), members, regrow)
        attempts.append(attempt)
        if attempt.failure is None:
            rendezvous.done(round_number if rendezvous.active else 0)
            return LaunchResult(0, attempts)
        if group.stop.signum is not None:
            return LaunchResult(128 + group.stop.signum, attempts)
        if group.deadline is not None and time.monotonic() >= group.deadline:
            break
        if attempt.planned:
            rejoined = slots.rejoin_due()
            _say(stderr, f"attempt {attempt.number} stopped so that "
                         + (f"worker slot(s) {rejoined} rejoin" if rejoined else "hosts rejoin"))
            continue
        if restarts >= group.max_restarts:
            break
        restarts += 1
        message = f"attempt {attempt.number} failed: {attempt.failure}; "
        if not group.hosts:
            culprits = attempt.stopped_first or [attempt.failed_worker]
            dropped = slots.record_failure(members, [members[i] for i in culprits
                                                     if i is not None])
            slots.rejoin_due()
            if dropped:
                message += (f"dropping worker slot(s) {dropped} (failed {slots.slot_failures} "
                            f"attempt(s) in a row), going on with {len(slots.active())} "
                            "worker(s); ")
        _say(stderr, message + f"restarting ({restarts}/{group.max_restarts})")
    return LaunchResult(_exit_code_of(attempts[-1]), attempts)


def _say(stderr, message: str) -> None:
    if stderr is not None:
        stderr.write(f"[launcher] {message}\n")


def _check_launch_args(num_workers, min_workers, max_restarts, startup_timeout, hang_timeout,
                       grace_period, timeout, hosts, host_index, base_port, min_hosts,
                       slot_failures):
    try:
        check_int("num_workers", num_workers)
        check_int("min_workers", min_workers)
        check_int("max_restarts", max_restarts, minimum=0)
        check_int("slot_failures", slot_failures)
        check_int("min_hosts", min_hosts)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if min_workers > num_workers:
        raise LaunchError(f"min_workers ({min_workers}) is more than num_workers "
                          f"({num_workers}); use -n MIN:MAX with MIN <= MAX.")
    for name, value in (("startup_timeout", startup_timeout), ("timeout", timeout),
                        ("hang_timeout", hang_timeout)):
        if value is not None and not value > 0:
            raise LaunchError(f"{name} must be > 0 seconds or None, got {value!r}.")
    if not grace_period >= 0:
        raise LaunchError(f"grace_period must be >= 0 seconds, got {grace_period!r}.")
    if hosts is not None:
        if not hosts or not all(isinstance(h, str) and h for h in hosts):
            raise LaunchError(f"hosts must be a non-empty list of addresses, got {hosts!r}.")
        if not is_int(host_index) or not 0 <= host_index < len(hosts):
            raise LaunchError(f"host_index must be in 0..{len(hosts) - 1}, got {host_index!r}.")
        if not is_int(base_port) or not 2 <= base_port <= 65535 - num_workers:
            raise LaunchError(f"base_port {base_port!r} leaves no room for {num_workers} "
                              "ports below 65536.")
        if min_hosts > len(hosts):
            raise LaunchError(f"min_hosts ({min_hosts}) is more than the {len(hosts)} hosts.")
        if min_workers != num_workers:
            raise LaunchError("With hosts, hosts are the elastic unit: use min_hosts, not "
                              "min_workers.")


@dataclasses.dataclass(frozen=True)
class _Group:
    """What every attempt of one launch shares."""

    target: targets.Target
    workdir: str
    reports_dir: str
    num_workers: int
    max_restarts: int
    startup_timeout: float | None
    hang_timeout: float | None
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
    log_dir: str
    verbose: bool
    preload: bool


class _Rendezvous:
    """The launcher's side of an elastic multi-host launch (inactive otherwise)."""

    def __init__(self, hosts, host_index, base_port, min_hosts, timeout):
        self.active = bool(hosts) and min_hosts < len(hosts)
        if not self.active:
            return
        name, port = _split_host(hosts[0], base_port)
        self.address = (name.strip("[]"), port - 1)
        self.host_index, self.timeout = host_index, timeout
        secret = os.environ.get(ENV_SECRET)
        self.secret = secret.encode() if secret else None
        self.server = (rendezvous_lib.RendezvousServer(self.address, len(hosts), min_hosts,
                                                       timeout, self.secret)
                       if host_index == 0 else None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.active and self.server is not None:
            self.server.close()

    def join(self) -> tuple[int, list[int]]:
        return rendezvous_lib.join(self.address, self.host_index, self.timeout + 60,
                                   self.secret)

    def regrow_check(self, round_number: int):
        """A check that is true once a host waits to join (polled every few seconds)."""
        next_poll = [time.monotonic() + rendezvous_lib.POLL_SECONDS]

        def check() -> bool:
            if time.monotonic() < next_poll[0]:
                return False
            next_poll[0] = time.monotonic() + rendezvous_lib.POLL_SECONDS
            return rendezvous_lib.should_regrow(self.address, round_number, self.secret)

        return check

    def done(self, round_number: int) -> None:
        if self.active:
            rendezvous_lib.report_done(self.address, round_number, self.secret)


def _tf_configs(group: _Group, members: list[int]) -> tuple[list[dict], int, int]:
    """This host's workers' TF_CONFIGs, the global index of the first, and the total."""
    n = group.num_workers
    if group.hosts is None:
        return cluster_lib.local_tf_configs(len(members), group.host), 0, len(members)
    addresses = []
    for m in members:
        name, port = _split_host(group.hosts[m], group.base_port)
        addresses += [f"{name}:{port + i}" for i in range(n)]
    first = members.index(group.host_index) * n
    configs = [{"cluster": {"worker": addresses}, "task": {"type": "worker", "index": first + i}}
               for i in range(n)]
    for config in configs:
        cluster_lib.parse_tf_config(config)
    return configs, first, len(addresses)


def _split_host(entry: str, base_port: int) -> tuple[str, int]:
    """"host" -> (host, base_port); "host:port" or "[v6]:port" -> (host, port)."""
    name, sep, port = entry.rpartition(":")
    if sep and port.isdigit() and (not name.count(":") or name.endswith("]")):
        return name, int(port)
    return entry, base_port


def _run_attempt(group: _Group, number: int, members: list[int], regrow) -> Attempt:
    """Starts this host's workers of attempt `number` and supervises them until it ends.

    Args:
        members: The slots (one host) or hosts taking part.
        regrow: None, or a check that is true once the launch should stop this attempt
            so that dropped slots or waiting hosts can rejoin.
    """
    configs, first, total = _tf_configs(group, members)
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
    attempt_dir = os.path.join(group.log_dir, f"attempt-{number}")
    os.makedirs(attempt_dir, exist_ok=True)
    indices = [first + i for i in range(len(configs))]
    console = console_lib.Console(indices, group.stdout, group.stderr, verbose=group.verbose)
    processes = ProcessGroup(commands, console,
                             [os.path.join(attempt_dir, f"worker-{i}.log") for i in indices],
                             group.preload)
    liveness = Liveness([w.pid for w in processes.workers], first, group.reports_dir, number,
                        [c["cluster"]["worker"][c["task"]["index"]] for c in configs],
                        group.startup_timeout if total > 1 else None, group.hang_timeout,
                        sees_every_worker=group.hosts is None)
    failure = failed = None
    planned = False
    started = time.monotonic()
    while failure is None:
        codes = processes.returncodes()
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        stall = liveness.check(codes)
        if bad:
            # A worker that failed while a peer was stopped failed because of it.
            stall = stall or liveness.stopped_now()
            failed = bad[0]
            failure = f"worker {first + failed} failed with " + _status(codes[failed])
            if codes[failed] in EXIT_CODES:
                failure += f" ({EXIT_CODES[codes[failed]]})"
            if stall is not None and stall.worker != failed:
                failure = f"{stall.failure}; then {failure}"
                failed = stall.worker
        elif stall is not None:
            failed, failure = stall.worker, stall.failure
        elif all(c == 0 for c in codes):
            break
        elif group.stop.signum is not None:
            failure = f"launcher received {signal.Signals(group.stop.signum).name}"
        elif group.deadline is not None and time.monotonic() >= group.deadline:
            failure = "the launch timed out"
        elif regrow is not None and liveness.started and regrow():
            failure, planned = "stopped by the launcher so that the group can grow back", True
            # As on preemption: BackupAndRestore saves at one step on every worker.
            for worker in processes.workers:
                worker.signal(signal.SIGTERM)
        if failure is None:
            time.sleep(_POLL_SECONDS)
    if stall is not None:
        # Stopped or stalled: it cannot save or report; the others need not wait for it.
        processes.workers[failed].signal(signal.SIGKILL)
    elif planned or (failed is not None and processes.returncodes()[failed] in _PEERS_FOLLOW):
        # Peers save at the same step (preemption) or write their flight-recorder
        # reports (hang) and exit on their own: give them time to.
        deadline = time.monotonic() + max(group.grace_period, _PEERS_FOLLOW_SECONDS)
        while any(c is None for c in processes.returncodes()) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
    processes.stop(group.grace_period)
    workers = [_worker_result(i, w, result_paths[i], group.target)
               for i, w in enumerate(processes.workers)]
    attempt = Attempt(number, workers, failure, failed, members=members, planned=planned,
                      seconds=time.monotonic() - started)
    if stall is not None:
        attempt.stopped_first = [failed]
    elif failure is not None and not planned:
        found = reports.read(group.reports_dir, number)
        culprits = [i - first for i in reports.stopped_first(found)
                    if first <= i < first + len(workers)]
        if found and culprits:
            attempt.stopped_first = culprits
            attempt.failure += "; " + reports.describe(found, [first + i for i in culprits])
    if failure is not None and not planned:
        _say_root_cause(group.stderr, attempt, first)
    return attempt


def _say_root_cause(stderr, attempt: Attempt, first: int) -> None:
    """The block that ends a failed attempt: who failed first, how, its last lines."""
    culprit = (attempt.stopped_first or [attempt.failed_worker])[0]
    if culprit is None:
        return
    worker = attempt.workers[culprit]
    tail = [line for line in worker.output if not console_lib.NOISE.search(line)]
    tail = tail[-_ROOT_CAUSE_LINES:]
    _say(stderr, f"root cause: worker {first + culprit} (attempt {attempt.number}, "
                 f"{worker.status}); its last {len(tail)} line(s), all in {worker.log_path}:"
         + "".join(f"\n[launcher]   | {line.rstrip()}" for line in tail))


def _worker_result(index, worker, result_path, resolved) -> WorkerResult:
    value = targets.read_result(result_path) if resolved.is_function else None
    return WorkerResult(index, worker.pid, worker.returncode, list(worker.output), value,
                        worker.log_path)


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
