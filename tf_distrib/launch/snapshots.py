"""The launcher's in-memory snapshot directory: made in /dev/shm per launch, freed at its end.

The workers write their snapshots there (`tf_distrib.callbacks.memory_snapshot`); the
directory outlives them, so a restarted group resumes from it, and it dies with the
launch: `owned()` deletes it however the launch ends, and a launch whose launcher was
killed leaves it to the next launch on the host, which deletes every snapshot directory
whose launcher is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from tf_distrib.launch import liveness

SHARED_MEMORY = "/dev/shm"
PREFIX = "tf_distrib-snapshots-"


@contextlib.contextmanager
def owned(enabled: bool = True, root: str = SHARED_MEMORY):
    """A new snapshot directory for this launch (None without /dev/shm), deleted at exit.

    Args:
        enabled: False yields None and makes nothing. Defaults to True.
        root: Where to make it. Defaults to /dev/shm.
    """
    if not enabled or not os.path.isdir(root) or not os.access(root, os.W_OK):
        yield None
        return
    remove_stale(root)
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def of_launcher(pid: int, root: str = SHARED_MEMORY) -> list[str]:
    """The snapshot directories that the launcher with process id `pid` made and holds."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return [os.path.join(root, name) for name in names if name.startswith(f"{PREFIX}{pid}-")]


def remove_stale(root: str = SHARED_MEMORY) -> list[str]:
    """Deletes the snapshot directories whose launcher no longer runs; returns them."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(PREFIX):].partition("-")[0]
            if name.startswith(PREFIX) and pid.isdigit() and (
                    liveness.process_state(int(pid)) in (None, "Z")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed.append(os.path.join(root, name))
    return removed
