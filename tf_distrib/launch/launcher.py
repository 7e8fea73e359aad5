"""`launch()`: run a training target on N workers with TF_CONFIG, restart on failure."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
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
from tf_distrib import contract
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
from tf_distrib.health import timeline
from tf_distrib.launch import console as console_lib
from tf_distrib.launch import forkserver, membership, reports, snapshots, targets, top
from tf_distrib.launch import preload as preload_lib
from tf_distrib.launch import rendezvous as rendezvous_lib
from tf_distrib.launch.config import LaunchConfig, with_overrides
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

    Example:

    ```python
    for worker in result.workers:
        print(worker.index, worker.status, worker.log_path)
    ```
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

    Example:

    ```python
    for attempt in result.attempts:
        print(attempt.number, attempt.failure, attempt.stopped_first)
    ```
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

    Example:

    ```python
    result = td.launch.launch(train, num_workers=2, max_restarts=1)
    if result.exit_code:
        print(result.failure_report())
    ```
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


def launch(target: str | Sequence[str] | Callable, num_workers: int | None = None, *,
           args: Sequence = (), kwargs: Mapping | None = None,
           config: LaunchConfig | None = None, **overrides) -> LaunchResult:
    """Runs `target` on `num_workers` worker processes with TF_CONFIG; restarts on failure.

    Each worker gets its TF_CONFIG on fresh free ports (per attempt) and the variables of
    `tf_distrib.contract` (its index, the group's size, the attempt, a new random secret
    per launch for the gradient transport, the report directory). Each worker's complete
    output goes to `log_dir`/attempt-N/worker-I.log; the console shows it condensed,
    prefixed "[worker i] " (`tf_distrib.launch.console`), and a failed attempt ends with
    a root-cause block. When a worker fails, the whole group is stopped (SIGTERM, then
    SIGKILL after `grace_period`) and started again while restarts remain; the workers'
    flight-recorder reports name the ones that stopped first (`Attempt.stopped_first`).
    Elastic launches (`min_workers`, or `min_hosts` with `hosts`) go on with fewer
    workers when some cannot (`tf_distrib.launch.membership`, `.rendezvous`).

    TensorFlow's gRPC servers have no authentication: by default every worker binds
    to 127.0.0.1, reachable from this machine only.

    Args:
        target: A script path, "-m pkg.module", or a Python function (pickled with
            cloudpickle, so notebook functions work; its return value comes back in
            `LaunchResult.values`).
        num_workers: Workers per host. Defaults to None: `config.num_workers`.
        args: Script arguments, or the function's positional arguments. Defaults to ().
        kwargs: The function's keyword arguments. Defaults to None.
        config: Every other option (`LaunchConfig`). Defaults to None: its defaults.
        **overrides: `LaunchConfig` fields that replace `config`'s, e.g.
            `max_restarts=2`.

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
    if num_workers is not None:
        overrides["num_workers"] = num_workers
    if "env" in overrides:  # any mapping, None for none
        overrides["env"] = dict(overrides["env"] or {})
    if overrides.get("hosts") is not None:  # any sequence
        overrides["hosts"] = list(overrides["hosts"])
    config = with_overrides(config, overrides)
    stdout, stderr = (None, None) if config.quiet else (sys.stdout, sys.stderr)
    preload = _preloaded(config.preload, target, stderr)
    log_dir = config.log_dir or tempfile.mkdtemp(
        prefix=time.strftime("tf_distrib_logs_%Y%m%d-%H%M%S_"))
    os.makedirs(log_dir, exist_ok=True)
    config = dataclasses.replace(
        config, log_dir=log_dir, preload=preload,
        verbose=config.verbose or os.environ.get(console_lib.ENV_VERBOSE) == "1")
    _say(stderr, f"every worker's full output: {log_dir}"
         + ("" if config.verbose else " (TensorFlow's start-up notices and repeated lines "
                                      "are condensed here; --verbose shows all)"))
    with tempfile.TemporaryDirectory(prefix="tf_distrib_launch_") as workdir:
        reports_dir = os.path.join(workdir, "reports")
        os.makedirs(reports_dir)
        with _StopSignals() as stop, _Rendezvous(config) as rendezvous, \
                snapshots.owned(config.snapshots) as snapshot_dir:
            group = _Group(
                config=config, target=targets.resolve(target, args, kwargs, workdir),
                workdir=workdir, reports_dir=reports_dir,
                env=_shared_env(config, reports_dir, snapshot_dir),
                deadline=None if config.timeout is None else time.monotonic() + config.timeout,
                stop=stop, stdout=stdout, stderr=stderr)
            slots = membership.Slots(config.num_workers, config.fewest_workers,
                                     config.slot_failures, config.rejoin_interval)
            with _JobFiles(config) as files:
                files.result = _attempts(group, slots, rendezvous, stderr)
                return files.result


# Where the workers of a launch with a timeline write their parts, in its log directory.
_TIMELINE_DIR = "timeline"


class _JobFiles:
    """What `tf-distrib top` and `--timeline` read: the launch's state, its registration,
    and at its end the workers' timeline parts merged."""

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.result: LaunchResult | None = None

    def __enter__(self):
        self.registration = top.register(self.config.log_dir)
        top.write_launch(self.config.log_dir, state="running", attempt=0, restarts=0)
        return self

    def __exit__(self, *exc):
        result = self.result
        top.write_launch(self.config.log_dir, state="finished",
                         exit_code=None if result is None else result.exit_code,
                         restarts=0 if result is None else result.restarts)
        if self.registration is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.registration)
        if self.config.timeline:
            directory = os.path.join(self.config.log_dir, _TIMELINE_DIR)
            parts = sorted(glob.glob(os.path.join(directory, "worker-*.json")))
            timeline.merge(parts, self.config.timeline)


def _preloaded(preload: bool | None, target, stderr) -> bool:
    """Whether the workers are forked from a preloaded process: `preload`, else
    TF_DISTRIB_PRELOAD (1 or 0), else whenever the target is safe to preload."""
    if preload is None and os.environ.get(forkserver.ENV_PRELOAD) in ("0", "1"):
        preload = os.environ[forkserver.ENV_PRELOAD] == "1"
    if preload:
        forkserver.check_supported()
        return True
    if preload is None:
        reason = preload_lib.reason_not_to(target)
        if reason is None:
            return True
        _say(stderr, f"workers start as fresh processes: {reason} (--preload forks them "
                     "anyway)")
    return False


def _starting(config: LaunchConfig, number: int, restarts: int) -> None:
    """Says that attempt `number` starts (for `top`); drops the timeline parts of the last."""
    top.write_launch(config.log_dir, state="running", attempt=number, restarts=restarts)
    for part in glob.glob(os.path.join(config.log_dir, _TIMELINE_DIR, "worker-*.json")):
        with contextlib.suppress(OSError):
            os.unlink(part)


def _shared_env(config: LaunchConfig, reports_dir: str,
                snapshot_dir: str | None) -> dict[str, str]:
    """The variables every worker of every attempt gets, beyond its own TF_CONFIG."""
    env = {ENV_REPORT_DIR: reports_dir,
           contract.ENV_STATUS_DIR: os.path.join(config.log_dir, top.STATUS_DIR), **config.env}
    if snapshot_dir is not None:
        env[contract.ENV_SNAPSHOT_DIR] = snapshot_dir
    if config.timeline:
        env[contract.ENV_TIMELINE_DIR] = os.path.join(config.log_dir, _TIMELINE_DIR)
    if config.hang_timeout is not None:
        env[ENV_HANG_TIMEOUT] = str(config.hang_timeout)
    if ENV_SECRET not in os.environ and ENV_SECRET not in env and not config.hosts:
        env[ENV_SECRET] = secrets.token_hex(32)
    return env


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
        _starting(group.config, len(attempts), restarts)
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
        if restarts >= group.config.max_restarts:
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
        _say(stderr, message + f"restarting ({restarts}/{group.config.max_restarts})")
    return LaunchResult(_exit_code_of(attempts[-1]), attempts)


def _say(stderr, message: str) -> None:
    if stderr is not None:
        stderr.write(f"[launcher] {message}\n")


@dataclasses.dataclass(frozen=True)
class _Group:
    """What every attempt of one launch shares."""

    config: LaunchConfig
    target: targets.Target
    workdir: str
    reports_dir: str
    env: dict
    deadline: float | None
    stop: _StopSignals
    stdout: object
    stderr: object

    @property
    def hosts(self) -> list[str] | None:
        return self.config.hosts


class _Rendezvous:
    """The launcher's side of an elastic multi-host launch (inactive otherwise)."""

    def __init__(self, config: LaunchConfig):
        hosts = config.hosts
        self.active = bool(hosts) and config.fewest_hosts < len(hosts)
        if not self.active:
            return
        name, port = _split_host(hosts[0], config.base_port)
        self.address = (name.strip("[]"), port - 1)
        self.host_index, self.timeout = config.host_index, config.rendezvous_timeout
        secret = os.environ.get(ENV_SECRET)
        self.secret = secret.encode() if secret else None
        self.server = (rendezvous_lib.RendezvousServer(self.address, len(hosts),
                                                       config.fewest_hosts, self.timeout,
                                                       self.secret)
                       if self.host_index == 0 else None)

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
    config = group.config
    n = config.num_workers
    if config.hosts is None:
        return cluster_lib.local_tf_configs(len(members), config.host), 0, len(members)
    addresses = []
    for m in members:
        name, port = _split_host(config.hosts[m], config.base_port)
        addresses += [f"{name}:{port + i}" for i in range(n)]
    first = members.index(config.host_index) * n
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
    result_paths = [os.path.join(group.workdir, f"result-{number}-{i}.pkl")
                    for i in range(len(configs))]
    processes, liveness = _start(group, number, configs, first, total, result_paths)
    started = time.monotonic()
    watch = _watch(group, processes, liveness, first, regrow)
    _stop(group, processes, watch)
    workers = [_worker_result(i, w, result_paths[i], group.target)
               for i, w in enumerate(processes.workers)]
    attempt = Attempt(number, workers, watch.failure, watch.failed, members=members,
                      planned=watch.planned, seconds=time.monotonic() - started)
    _post_mortem(group, attempt, first, stalled=watch.stall is not None)
    return attempt


def _worker_env(group: _Group, config: dict, index: int, total: int, number: int,
                local: tuple[int, int]) -> dict[str, str]:
    """One worker's environment: the launcher's, the launch's, its TF_CONFIG and contract.

    `local` is (its index among this host's workers, their number)."""
    env = {**os.environ, **group.env}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update({
        "TF_CONFIG": json.dumps(config),
        ENV_WORKER_INDEX: str(index),
        ENV_NUM_WORKERS: str(total),
        contract.ENV_LOCAL_INDEX: str(local[0]),
        contract.ENV_LOCAL_WORKERS: str(local[1]),
        ENV_ATTEMPT: str(number),
        ENV_MAX_RESTARTS: str(group.config.max_restarts),
        "PYTHONUNBUFFERED": "1",
    })
    if group.config.startup_timeout is not None:
        env[ENV_STARTUP_TIMEOUT] = str(group.config.startup_timeout)
    return env


def _start(group: _Group, number: int, configs: list[dict], first: int, total: int,
           result_paths: list[str]) -> tuple[ProcessGroup, Liveness]:
    """Starts the attempt's workers, with their log files and their liveness check."""
    config = group.config
    commands = [(group.target.command(path),
                 _worker_env(group, c, first + i, total, number, (i, len(configs))))
                for i, (c, path) in enumerate(zip(configs, result_paths, strict=True))]
    attempt_dir = os.path.join(config.log_dir, f"attempt-{number}")
    os.makedirs(attempt_dir, exist_ok=True)
    indices = [first + i for i in range(len(configs))]
    console = console_lib.Console(indices, group.stdout, group.stderr, verbose=config.verbose)
    processes = ProcessGroup(commands, console,
                             [os.path.join(attempt_dir, f"worker-{i}.log") for i in indices],
                             config.preload)
    liveness = Liveness([w.pid for w in processes.workers], first, group.reports_dir, number,
                        [c["cluster"]["worker"][c["task"]["index"]] for c in configs],
                        config.startup_timeout if total > 1 else None, config.hang_timeout,
                        sees_every_worker=config.hosts is None)
    return processes, liveness


@dataclasses.dataclass
class _Watched:
    """How an attempt ended, as its supervision saw it."""

    failure: str | None = None
    failed: int | None = None  # index in the attempt's workers
    stall: object = None  # a Liveness stall: stopped or stalled, it cannot save or report
    planned: bool = False


def _watch(group: _Group, processes: ProcessGroup, liveness: Liveness, first: int,
           regrow) -> _Watched:
    """Polls the workers until all exit with 0 or the attempt fails; says how it ended."""
    watched = _Watched()
    while watched.failure is None:
        codes = processes.returncodes()
        bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
        stall = liveness.check(codes)
        if bad:
            # A worker that failed while a peer was stopped failed because of it.
            stall = stall or liveness.stopped_now()
            watched.failed = bad[0]
            watched.failure = f"worker {first + bad[0]} failed with " + _status(codes[bad[0]])
            if codes[bad[0]] in EXIT_CODES:
                watched.failure += f" ({EXIT_CODES[codes[bad[0]]]})"
            if stall is not None and stall.worker != bad[0]:
                watched.failure = f"{stall.failure}; then {watched.failure}"
                watched.failed = stall.worker
        elif stall is not None:
            watched.failed, watched.failure = stall.worker, stall.failure
        elif all(c == 0 for c in codes):
            return watched
        elif group.stop.signum is not None:
            watched.failure = f"launcher received {signal.Signals(group.stop.signum).name}"
        elif group.deadline is not None and time.monotonic() >= group.deadline:
            watched.failure = "the launch timed out"
        elif regrow is not None and liveness.started and regrow():
            watched.failure = "stopped by the launcher so that the group can grow back"
            watched.planned = True
            # As on preemption: BackupAndRestore saves at one step on every worker.
            for worker in processes.workers:
                worker.signal(signal.SIGTERM)
        watched.stall = stall
        if watched.failure is None:
            time.sleep(_POLL_SECONDS)
    return watched


def _stop(group: _Group, processes: ProcessGroup, watched: _Watched) -> None:
    """Stops what is left of the attempt, giving peers that stop themselves time to."""
    if watched.stall is not None:
        # Stopped or stalled: it cannot save or report; the others need not wait for it.
        processes.workers[watched.failed].signal(signal.SIGKILL)
    elif watched.planned or (watched.failed is not None
                             and processes.returncodes()[watched.failed] in _PEERS_FOLLOW):
        # Peers save at the same step (preemption) or write their flight-recorder
        # reports (hang) and exit on their own: give them time to.
        deadline = time.monotonic() + max(group.config.grace_period, _PEERS_FOLLOW_SECONDS)
        while any(c is None for c in processes.returncodes()) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
    processes.stop(group.config.grace_period)


def _post_mortem(group: _Group, attempt: Attempt, first: int, stalled: bool) -> None:
    """Names who stopped first (liveness, else the flight-recorder reports) and says so."""
    if stalled:
        attempt.stopped_first = [attempt.failed_worker]
    elif attempt.failure is not None and not attempt.planned:
        found = reports.read(group.reports_dir, attempt.number)
        culprits = [i - first for i in reports.stopped_first(found)
                    if first <= i < first + len(attempt.workers)]
        if found and culprits:
            attempt.stopped_first = culprits
            attempt.failure += "; " + reports.describe(found, [first + i for i in culprits])
    if attempt.failure is not None and not attempt.planned:
        _say_root_cause(group.stderr, attempt, first)


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
