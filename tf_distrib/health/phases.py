"""Where a worker is in its start-up, as its launcher sees it.

Before its first step a worker waits on its peers or storage (the cluster's and the
transport's rendezvous, restoring a backup, tracing the first step), where the hang
watchdog cannot see it. tf_distrib enters each phase itself; under `tf-distrib launch`
each change is written to the worker's report directory, from which the launcher
names the phase in which a worker stopped. Plain Python, no TensorFlow.
Example:

```python
from tf_distrib.health import phases

with phases.entered(phases.RESTORING):   # the phase until the block ends
    restore_my_state()
```
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from tf_distrib import contract

STARTING = "starting"
CLUSTER = "cluster"
TRANSPORT = "transport"
BUILDING = "building"
RESTORING = "restoring"
FIRST_STEP = "first_step"
TRAINING = "training"

#: Every phase in the order a worker passes them, and its name in messages.
DESCRIPTIONS = {
    STARTING: "start-up (its script, before make_strategy)",
    CLUSTER: "TensorFlow's cluster rendezvous (coordination service)",
    TRANSPORT: "the transport's rendezvous",
    BUILDING: "building the model (after make_strategy, before fit)",
    RESTORING: "restoring a backup",
    FIRST_STEP: "the first step (tracing, first collective)",
    TRAINING: "training",
}
ORDER = list(DESCRIPTIONS)
#: Phases in which a worker runs only tf_distrib's and TensorFlow's code, waiting for its
#: peers: once every peer has reached one, nothing but a frozen worker keeps it there.
RENDEZVOUS = (CLUSTER, TRANSPORT)

_current = STARTING


def current() -> str:
    """The phase this process is in (`STARTING` until tf_distrib enters another)."""
    return _current


def enter(phase: str) -> None:
    """Moves this worker to `phase`, and tells its launcher when it runs under one.

    Start-up only goes forward: once a worker trains, later phases (a second `fit`
    restoring a backup) are not start-up any more and are not reported.

    Raises:
        ValueError: `phase` is not one of `ORDER`.
    """
    global _current
    if phase not in DESCRIPTIONS:
        raise ValueError(f"Unknown start-up phase {phase!r}; use one of {ORDER}.")
    if _current == TRAINING or phase == _current:
        return
    _current = phase
    path = _path(os.environ.get(contract.ENV_REPORT_DIR), contract.attempt(),
                 contract.worker_index())
    if path is None:
        return
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"phase": phase, "since": time.time(), "pid": os.getpid()}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher is gone or its directory with it: nothing to tell


@contextlib.contextmanager
def entered(phase: str):
    """`phase` while inside the block; the phase before it afterwards (if still start-up)."""
    before = _current
    enter(phase)
    try:
        yield
    finally:
        if _current == phase:
            enter(before)


def read(directory: str, attempt: int, index: int) -> tuple[str, float] | None:
    """The launcher's side: worker `index`'s last reported phase and since when.

    Returns:
        (phase, since as time.time()), or None when the worker has reported none (it
        has not reached `make_strategy`, or it does not use tf_distrib).
    """
    try:
        with open(_path(directory, attempt, index)) as f:
            report = json.load(f)
        return report["phase"], float(report["since"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def describe(phase: str) -> str:
    """The phase in words, for messages."""
    return DESCRIPTIONS.get(phase, phase)


def _path(directory: str | None, attempt: int, index: int | None) -> str | None:
    if not directory or index is None:
        return None
    return os.path.join(directory, f"phase-{attempt}-{index}.json")
