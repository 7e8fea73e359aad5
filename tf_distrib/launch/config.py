"""`LaunchConfig`: every launch option, its default and its check, defined once.

The command line (`cli.py`, whose flags are generated from the fields), job files
(`job.py`) and `launch()` all build a `LaunchConfig`; `tf_distrib.testing` reads its
defaults here too.
"""

from __future__ import annotations

import dataclasses
import types
import typing

from tf_distrib._checks import is_int
from tf_distrib.launch.errors import LaunchError


def _option(default, help: str = "", *, cli: bool = True):
    """A field with its command-line help; `cli=False` keeps it off the command line."""
    if callable(default):  # a mutable default: each config gets its own
        return dataclasses.field(default_factory=default, metadata={"help": help, "cli": cli})
    return dataclasses.field(default=default, metadata={"help": help, "cli": cli})


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Every option of a launch, with its default; it validates itself.

    `tf-distrib launch` flags, job-file keys and `launch(target, config=..., **overrides)`
    keywords are these fields' names (flags with dashes).

    Args:
        num_workers: Workers per host (the most, for an elastic launch), >= 1.
            Defaults to 1.
        min_workers: The fewest workers an attempt on this host may run: a worker slot
            that fails `slot_failures` attempts in a row is dropped while at least this
            many remain. Defaults to None: `num_workers` (not elastic).
        max_restarts: Restarts of the group after failures. Defaults to 0.
        startup_timeout: Seconds a worker may take from its start to its first training
            step (`tf_distrib.health.phases`); the worker furthest behind is named with
            its phase. None disables the check. Defaults to 300.
        hang_timeout: Seconds without a finished step after which the workers'
            watchdogs stop them. Defaults to None: the strategy's, 600.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping. Defaults to 5.
        timeout: Seconds the whole launch may run. Defaults to None (no limit).
        env: Extra environment variables for the workers. Defaults to {}.
        host: The address local workers bind to. Defaults to "127.0.0.1".
        hosts: A static multi-host launch: every host as "host" or "host:port", in the
            same order on each host. Defaults to None (one host, free ports).
        host_index: This host's position in `hosts`. Defaults to 0.
        base_port: First port of each host in a multi-host launch. Defaults to 29400.
        min_hosts: With `hosts`, the fewest hosts an attempt may start with (an elastic
            rendezvous on host 0's first port minus one). Defaults to None: every host.
        rendezvous_timeout: Seconds an elastic multi-host attempt waits for missing
            hosts. Defaults to 60.
        slot_failures: Failed attempts in a row that drop a worker slot. Defaults to 2.
        rejoin_interval: Seconds before a dropped slot or missing host is tried again.
            Defaults to 600.
        log_dir: Where every worker's complete output goes, one file per worker and
            attempt. Defaults to None: a new temporary directory, printed at the start.
        verbose: Show every line of every worker, TensorFlow's start-up notices
            included. Defaults to False (or TF_DISTRIB_VERBOSE=1).
        preload: Fork workers and restarts from a process that has already imported
            TensorFlow (`tf_distrib.launch.forkserver`): seconds sooner each. Defaults to
            None: TF_DISTRIB_PRELOAD (1 or 0) when set, else preloaded unless the target
            sets TensorFlow's environment before importing it (`tf_distrib.launch.preload`,
            and the launcher says so).
        snapshots: Give the workers of each host a directory in /dev/shm that outlives
            them and is deleted when the launch ends (`contract.ENV_SNAPSHOT_DIR`):
            `tf_distrib.callbacks.BackupAndRestore` keeps the newest training state
            there, so a restart loses only the steps since the last snapshot (every
            step, or as often as 3% of the step time allows). Defaults to True.
        timeline: Where to write, when the launch ends, the last steps of every worker
            of its last attempt as one Chrome trace (`tf_distrib.health.timeline`).
            Defaults to None: no timeline.
        quiet: Keep the workers' output in the results and log files only. Defaults
            to False.

    Raises:
        LaunchError: for a value of the wrong type or out of range.

    Example:

    ```python
    config = td.launch.LaunchConfig(num_workers=2, max_restarts=3)
    td.launch.launch("train.py", config=config, hang_timeout=120)
    ```
    """

    num_workers: int = _option(1, "workers on this host, N or MIN:MAX (elastic)")
    min_workers: int | None = _option(None, cli=False)
    max_restarts: int = _option(0, "restarts after failures")
    startup_timeout: float | None = _option(
        300.0, "seconds for each worker to reach its first training step (0 disables it)")
    hang_timeout: float | None = _option(
        None, "seconds without a finished training step before the workers' watchdogs stop "
              "them (default: the strategy's, 600)")
    grace_period: float = _option(5.0, "seconds between SIGTERM and SIGKILL when stopping")
    timeout: float | None = _option(None, "limit for the whole launch in seconds")
    env: dict[str, str] = _option(dict, cli=False)
    host: str = _option("127.0.0.1", cli=False)
    hosts: list[str] | None = _option(
        None, "static multi-host launch: comma-separated host[:port] list, identical on "
              "every host")
    host_index: int = _option(0, "this host's position in --hosts")
    base_port: int = _option(29400, "first port of each host")
    min_hosts: int | None = _option(
        None, "with --hosts: the fewest hosts an attempt may start with (elastic; default: "
              "all)")
    rendezvous_timeout: float = _option(
        60.0, "seconds an elastic multi-host attempt waits for missing hosts")
    slot_failures: int = _option(
        2, "failed attempts in a row that drop a worker slot, with -n MIN:MAX")
    rejoin_interval: float = _option(
        600.0, "seconds before a dropped slot or missing host is tried again")
    log_dir: str | None = _option(
        None, "directory for every worker's complete output, one file per worker and "
              "attempt (default: a new temporary one)")
    verbose: bool = _option(
        False, "show every line of every worker, TensorFlow's start-up notices and "
               "repeated lines included (also TF_DISTRIB_VERBOSE=1)")
    preload: bool | None = _option(
        None, "fork workers (and restarts) from a process that has already imported "
              "TensorFlow and Keras, seconds sooner each (default: unless the script sets "
              "TensorFlow's environment before importing it; also TF_DISTRIB_PRELOAD=1/0)")
    snapshots: bool = _option(
        True, "keep each host's newest training state in shared memory that outlives the "
              "workers, for BackupAndRestore to resume from (a restart loses only the steps "
              "since the last snapshot; default: on, where /dev/shm exists)")
    timeline: str | None = _option(
        None, "when the launch ends, write the last steps of every worker here as a Chrome "
              "trace (opens in Perfetto)")
    quiet: bool = _option(False, cli=False)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name), _HINTS[field.name])
        self._check_ranges()

    @property
    def fewest_workers(self) -> int:
        """`min_workers`, or `num_workers` when the launch is not elastic."""
        return self.num_workers if self.min_workers is None else self.min_workers

    @property
    def fewest_hosts(self) -> int:
        """`min_hosts`, or every host (1 without `hosts`)."""
        if self.min_hosts is not None:
            return self.min_hosts
        return len(self.hosts) if self.hosts else 1

    def _check_ranges(self) -> None:
        for name in ("num_workers", "min_workers", "slot_failures", "min_hosts"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LaunchError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.max_restarts < 0:
            raise LaunchError(f"max_restarts must be an integer >= 0, got "
                              f"{self.max_restarts!r}.")
        if self.fewest_workers > self.num_workers:
            raise LaunchError(f"min_workers ({self.min_workers}) is more than num_workers "
                              f"({self.num_workers}); use -n MIN:MAX with MIN <= MAX.")
        for name in ("startup_timeout", "timeout", "hang_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise LaunchError(f"{name} must be > 0 seconds or None, got {value!r}.")
        if not self.grace_period >= 0:
            raise LaunchError(f"grace_period must be >= 0 seconds, got {self.grace_period!r}.")
        if self.hosts is not None:
            self._check_hosts()

    def _check_hosts(self) -> None:
        hosts = self.hosts
        if not hosts or not all(h for h in hosts):
            raise LaunchError(f"hosts must be a non-empty list of addresses, got {hosts!r}.")
        if not 0 <= self.host_index < len(hosts):
            raise LaunchError(f"host_index must be in 0..{len(hosts) - 1}, got "
                              f"{self.host_index!r}.")
        if not 2 <= self.base_port <= 65535 - self.num_workers:
            raise LaunchError(f"base_port {self.base_port!r} leaves no room for "
                              f"{self.num_workers} ports below 65536.")
        if self.fewest_hosts > len(hosts):
            raise LaunchError(f"min_hosts ({self.min_hosts}) is more than the {len(hosts)} "
                              "hosts.")
        if self.fewest_workers != self.num_workers:
            raise LaunchError("With hosts, hosts are the elastic unit: use min_hosts, not "
                              "min_workers.")


_HINTS = typing.get_type_hints(LaunchConfig)
FIELDS = {field.name: field for field in dataclasses.fields(LaunchConfig)}


def with_overrides(config: LaunchConfig | None, overrides: dict) -> LaunchConfig:
    """`config` (or the defaults) with `overrides`; an unknown name is a `LaunchError`."""
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise LaunchError(f"Unknown launch option(s) {unknown}; known options: "
                          f"{', '.join(FIELDS)}.")
    return dataclasses.replace(config or LaunchConfig(), **overrides)


def parse_worker_range(text: str) -> tuple[int | None, int]:
    """"N" -> (None, N); "MIN:MAX" -> (MIN, MAX) (an elastic launch).

    Raises:
        LaunchError: anything else, or MIN > MAX, or a count below 1.
    """
    low, sep, high = str(text).partition(":")
    if not (low.isdigit() and (not sep or high.isdigit())):
        raise LaunchError(f"The number of workers must be N or MIN:MAX (e.g. 2 or 1:4), got "
                          f"{text!r}.")
    minimum, maximum = int(low), int(high) if sep else int(low)
    if not sep and maximum < 1:
        raise LaunchError(f"num_workers must be an integer >= 1, got {text}.")
    if minimum < 1 or minimum > maximum:
        raise LaunchError(f"The number of workers MIN:MAX needs 1 <= MIN <= MAX, got {text!r}.")
    return (minimum if sep else None), maximum


def _check_type(name: str, value, hint) -> None:
    """Raises LaunchError unless `value` fits the field's annotation (bool is no int)."""
    if not _fits(value, hint):
        raise LaunchError(f"'{name}' has the wrong type ({type(value).__name__}: {value!r}).")


def _fits(value, hint) -> bool:
    if isinstance(hint, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list | tuple) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in value.items())
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_int(value)
    if hint is float:
        return is_int(value) or isinstance(value, float)
    return isinstance(value, hint)
