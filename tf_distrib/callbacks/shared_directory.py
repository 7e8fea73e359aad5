"""Whether every worker sees the backup directory the chief writes to."""

from __future__ import annotations

import itertools
import posixpath
import time
import uuid

import tensorflow as tf

from tf_distrib import _compat, cluster

# One check per `fit`: every worker counts its fits alike (as for preemption keys).
_runs = itertools.count(1)
_PROBE_PREFIX = ".tf_distrib-probe-"
# A file another NFS client just made can take a moment to show up.
_LOOKS, _LOOK_INTERVAL = 10, 0.5


def check(directory: str, strategy, timeout: float = 300.0) -> None:
    """Raises ValueError unless every worker of `strategy` sees what its chief writes there.

    Only the chief writes backups, and every worker restores from the newest it finds:
    a directory that is not shared (a path on each host's own disk) would let the chief
    resume from a backup while the others start afresh. The chief writes a probe file,
    publishes its name through TensorFlow's coordination service, and every worker says
    whether it sees it; all of them raise, naming the workers that do not.

    Args:
        directory: The backup directory.
        strategy: A MultiWorkerMirroredStrategy spanning several workers.
        timeout: Seconds to wait for the chief and every worker's answer (workers reach
            `fit` at different times). Defaults to 300.
    """
    spec = cluster.spec_of(strategy)
    tasks, me = spec.training_tasks, spec.task
    service, prefix = _compat.coordination_service(), f"tf_distrib/backup_dir/{next(_runs)}"
    milliseconds = int(timeout * 1000)
    chief = strategy.extended.should_checkpoint
    if chief:
        probe = posixpath.join(directory, f"{_PROBE_PREFIX}{uuid.uuid4().hex}")
        try:
            tf.io.gfile.makedirs(directory)
            with tf.io.gfile.GFile(probe, "w") as f:
                f.write(me)
            service.set_config_key_value(f"{prefix}/probe", posixpath.basename(probe))
        except (OSError, tf.errors.OpError) as e:
            service.set_config_key_value(f"{prefix}/probe", "")
            raise ValueError(f"BackupAndRestore: {me} cannot write to backup_dir {directory} "
                             f"({e}).") from e
    name = _get(service, f"{prefix}/probe", milliseconds, "the chief", directory)
    if not name:
        raise ValueError(f"BackupAndRestore: the chief cannot write to backup_dir {directory}.")
    # In this worker's own backup_dir: the same path, or what the worker was given.
    probe = posixpath.join(directory, name)
    service.set_config_key_value(f"{prefix}/{me}", "1" if _sees(probe) else "0")
    blind = [task for task in tasks
             if _get(service, f"{prefix}/{task}", milliseconds, task, directory) != "1"]
    if chief:
        tf.io.gfile.remove(probe)
    if blind:
        raise ValueError(
            f"BackupAndRestore: {', '.join(blind)} cannot see the files the chief writes to "
            f"backup_dir {directory}: it is not one directory shared by every worker (a path "
            "on each host's own disk?). Only the chief writes backups and every worker "
            "restores from what it sees, so they would resume from different states. Use a "
            "shared file system (NFS, ...) or an object store (gs://, s3://) that every "
            "worker reaches at the same path.")


def _sees(path: str) -> bool:
    """Whether `path` exists, looked for a few times: network file systems may lag."""
    for attempt in range(_LOOKS):
        if tf.io.gfile.exists(path):
            return True
        if attempt + 1 < _LOOKS:
            time.sleep(_LOOK_INTERVAL)
    return False


def _get(service, key: str, milliseconds: int, who: str, directory: str) -> str:
    try:
        return service.get_config_key_value(key, milliseconds)
    except tf.errors.DeadlineExceededError:
        raise TimeoutError(f"BackupAndRestore: {who} did not report within "
                           f"{milliseconds / 1000:g} s whether it sees backup_dir "
                           f"{directory}.") from None
