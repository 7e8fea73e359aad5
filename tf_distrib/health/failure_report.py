"""Failure reports: how a worker tells the launcher why it stopped.

A worker that stops for a reason it can name writes one JSON report to
TF_DISTRIB_REPORT_DIR, `report-<attempt>-<worker index>.json`: the hang watchdog
(`tf_distrib.health.watchdog`, with its flight recorder) and the gradient transport (a lost
peer) both write here, and `tf_distrib.launch.reports` reads them to name the worker
that stopped first. Plain Python, no TensorFlow.

Example:

```python
from tf_distrib.health import failure_report

failure_report.write_failure("worker:0", "lost worker:1", lost_peer="worker:1")
```
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Protocol

from tf_distrib import contract


class CollectiveState(Protocol):
    """What a report records of a worker's gradient transport."""

    mode: str | None

    def recent(self) -> list[dict]: ...

    def waiting_for(self) -> list[str]: ...


def transport_state(transport: CollectiveState | None) -> dict | None:
    """The transport's mode, last collectives and the peers it waits for (None: no transport)."""
    if transport is None:
        return None
    return {"mode": transport.mode, "recent": transport.recent(),
            "waiting_for": transport.waiting_for()}


def write(report: dict, directory: str | None = None) -> str | None:
    """Writes `report` (with a "task" key) atomically; returns its path, or None.

    Args:
        report: The report; "task" names the worker when no worker index is set.
        directory: Where to write it. Defaults to None: TF_DISTRIB_REPORT_DIR, and
            outside a launch (no such variable) nowhere.
    """
    directory = directory or os.environ.get(contract.ENV_REPORT_DIR)
    if not directory:
        return None
    index = contract.worker_index()
    worker = str(index) if index is not None else report["task"].replace(":", "-")
    path = os.path.join(directory, f"report-{contract.attempt()}-{worker}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)
    except OSError:
        return None
    return path


def paths(directory: str, attempt: int) -> dict[int, str]:
    """The report files of `attempt`'s workers in `directory`, by worker index."""
    found = {}
    for path in glob.glob(os.path.join(directory, f"report-{attempt}-*.json")):
        index = path.rsplit("-", 1)[1].removesuffix(".json")
        if index.isdigit():
            found[int(index)] = path
    return found


def write_failure(task: str, cause: str, transport: CollectiveState | None = None,
                  lost_peer: str | None = None) -> str | None:
    """A short report for a failure the worker can name; returns its path, or None.

    Args:
        task: This worker's task, e.g. "worker:0".
        cause: What happened, in words.
        transport: Its transport, whose last collectives go in the report. Defaults
            to None.
        lost_peer: The task of the peer this worker lost, if that is what happened.
            Defaults to None.
    """
    return write({"task": task, "pid": os.getpid(), "cause": cause, "fired_at": time.time(),
                  "lost_peer": lost_peer, "transport": transport_state(transport)})
