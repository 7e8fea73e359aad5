"""The launcher <-> worker contract: environment variables and exit statuses.

`tf-distrib launch` (and the engines' adapters) set these variables for each worker;
the strategy, the callbacks and the integrations read them here. A worker tells the
launcher why it stopped through its exit status. Plain Python, no TensorFlow: the
launcher imports it, and so does every worker. docs/launching.md tables them.

Example:

```python
from tf_distrib import contract

if contract.attempt() > 0:
    print("restarted; BackupAndRestore resumes where the last attempt stopped")
```
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

#: This worker's task index (torchrun's `RANK`).
ENV_WORKER_INDEX = "TF_DISTRIB_WORKER_INDEX"
#: Workers in this attempt (`WORLD_SIZE`).
ENV_NUM_WORKERS = "TF_DISTRIB_NUM_WORKERS"
#: 0 on the first start, then 1, 2, ... (`TORCHELASTIC_RESTART_COUNT`).
ENV_ATTEMPT = "TF_DISTRIB_ATTEMPT"
#: Restarts the launcher allows (`TORCHELASTIC_MAX_RESTARTS`).
ENV_MAX_RESTARTS = "TF_DISTRIB_MAX_RESTARTS"
#: Seconds the cluster may take to form.
ENV_STARTUP_TIMEOUT = "TF_DISTRIB_STARTUP_TIMEOUT"
#: Seconds without a finished training step before the watchdog fires.
ENV_HANG_TIMEOUT = "TF_DISTRIB_HANG_TIMEOUT"
#: The job's secret for the gradient transport's connections.
ENV_SECRET = "TF_DISTRIB_SECRET"
#: The gradient transport when `make_strategy` is not told one.
ENV_TRANSPORT = "TF_DISTRIB_TRANSPORT"
#: Where a worker writes its flight-recorder report when it hangs.
ENV_REPORT_DIR = "TF_DISTRIB_REPORT_DIR"
#: The glibc mmap threshold the strategies keep (bytes; 0: TensorFlow's).
ENV_MMAP_THRESHOLD = "TF_DISTRIB_MMAP_THRESHOLD"
#: 0: no native ops (the shared-memory transport's Python path, PowerSGD on TF's ops).
ENV_NATIVE_SUM = "TF_DISTRIB_NATIVE_SUM"
#: Where the native ops' builds (and remembered failed builds) live.
ENV_CACHE_DIR = "TF_DISTRIB_CACHE_DIR"
#: Where each worker writes its status for `tf-distrib top` (the launcher's log dir).
ENV_STATUS_DIR = "TF_DISTRIB_STATUS_DIR"
#: Where each worker writes its part of the launch's timeline (`--timeline`).
ENV_TIMELINE_DIR = "TF_DISTRIB_TIMELINE_DIR"
#: This host's directory in /dev/shm for in-memory snapshots, owned by its launcher.
ENV_SNAPSHOT_DIR = "TF_DISTRIB_SNAPSHOT_DIR"
#: This worker's index among its host's workers (torchrun's `LOCAL_RANK`).
ENV_LOCAL_INDEX = "TF_DISTRIB_LOCAL_INDEX"
#: Workers on this host in this attempt (`LOCAL_WORLD_SIZE`).
ENV_LOCAL_WORKERS = "TF_DISTRIB_LOCAL_WORKERS"

#: A worker saved a backup on SIGTERM (preemption) and exited; its peers save at the
#: same step and exit on their own. Restart the group: it resumes from that step.
PREEMPTED_EXIT_CODE = 42
#: The cluster did not form within the startup timeout (EX_TEMPFAIL): restart.
STARTUP_TIMEOUT_EXIT_CODE = 75
#: The hang watchdog saw no training step finish within the hang timeout, wrote its
#: flight-recorder report and aborted the worker: restart.
HUNG_EXIT_CODE = 76

EXIT_CODES = {
    PREEMPTED_EXIT_CODE: "preempted: saved a backup on SIGTERM",
    STARTUP_TIMEOUT_EXIT_CODE: "the cluster did not form within the startup timeout",
    HUNG_EXIT_CODE: "hung: no training step finished within the hang timeout",
}


def describe_exit_code(code: int) -> str | None:
    """What a tf_distrib exit status means, or None for other statuses."""
    return EXIT_CODES.get(code)


def env_seconds(name: str, default: float | None,
                environ: Mapping[str, str] | None = None) -> float | None:
    """A duration in seconds from the environment variable `name`.

    "inf" (or "0" for "no limit") gives `math.inf`; unset or empty gives `default`.

    Args:
        name: The variable's name.
        default: What an unset or empty variable gives.
        environ: The environment to read. Defaults to `os.environ`.

    Raises:
        ValueError: the value is not a number >= 0; the message names the variable.
    """
    value = (os.environ if environ is None else environ).get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{name}={value!r} is not a number of seconds >= 0 (0 or 'inf': no "
                         "limit). Fix or unset the variable.")
    return math.inf if seconds == 0 else seconds


def env_int(name: str, default: int | None,
            environ: Mapping[str, str] | None = None) -> int | None:
    """An integer >= 0 from the environment variable `name`; unset gives `default`.

    Args:
        name: The variable's name.
        default: What an unset or empty variable gives.
        environ: The environment to read. Defaults to `os.environ`.

    Raises:
        ValueError: the value is not an integer >= 0; the message names the variable.
    """
    value = (os.environ if environ is None else environ).get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not an integer >= 0. Fix or unset the variable.")
    return int(value)


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """tf_distrib's per-user cache: TF_DISTRIB_CACHE_DIR, else $XDG_CACHE_HOME/tf_distrib.

    The native op's builds live there.

    Args:
        environ: The environment to read. Defaults to `os.environ`.
    """
    env = os.environ if environ is None else environ
    return env.get(ENV_CACHE_DIR) or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tf_distrib")


def worker_index(environ: Mapping[str, str] | None = None) -> int | None:
    """This worker's index as the launcher numbered it, or None outside a launch.

    Args:
        environ: The environment to read. Defaults to `os.environ`.
    """
    return env_int(ENV_WORKER_INDEX, None, environ)


def num_workers(environ: Mapping[str, str] | None = None) -> int | None:
    """How many workers this attempt runs, or None outside a launch.

    Args:
        environ: The environment to read. Defaults to `os.environ`.
    """
    return env_int(ENV_NUM_WORKERS, None, environ)


def attempt(environ: Mapping[str, str] | None = None) -> int:
    """0 on the first start of the group, 1 after the first restart, ... (0 outside a launch).

    Args:
        environ: The environment to read. Defaults to `os.environ`.
    """
    return env_int(ENV_ATTEMPT, 0, environ)


def local_workers(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(this worker's index on its host, the host's workers); (0, 1) outside a launch.

    Args:
        environ: The environment to read. Defaults to `os.environ`.
    """
    index = env_int(ENV_LOCAL_INDEX, 0, environ)
    count = env_int(ENV_LOCAL_WORKERS, 1, environ)
    if not index < count:
        raise ValueError(f"{ENV_LOCAL_INDEX}={index} is not below {ENV_LOCAL_WORKERS}="
                         f"{count}. Fix or unset the variables.")
    return index, count


def snapshot_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """This host's in-memory snapshot directory, or None (no launcher, or turned off).

    Args:
        environ: The environment to read. Defaults to `os.environ`.
    """
    return (os.environ if environ is None else environ).get(ENV_SNAPSHOT_DIR) or None
