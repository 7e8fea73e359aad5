"""The faults a chaos trial injects, and how a worker injects them into itself.

A fault is drawn by the driver (`draw`) and carried to the workers as a dict; the worker
it names, on the attempt it names, injects it when its moment comes: a signal it sends
itself at a training step (as an outside killer would: the process cannot tell), or a
hook at the exact point a kill hurts most (while a backup's state file is written but
its manifest is not; inside the gradient transport's collective; halfway through the
copy of an in-memory snapshot, or after the copy and before its commit: a torn one).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading

#: Every fault a trial can draw. "full_disk" needs root (a small tmpfs as the backups'
#: file system).
FAULT_KINDS = ("sigkill", "sigstop", "sigterm", "startup", "kill_in_write",
               "kill_in_collective", "kill_in_snapshot", "torn_snapshot", "full_disk")
# Faults that end the attempt (the launcher restarts the group); a full disk does not.
RESTARTING = frozenset(FAULT_KINDS) - {"full_disk"}
# Where a worker may be stopped or killed before its first step (`tf_distrib.health.phases`).
STARTUP_PHASES = ("starting", "cluster", "transport", "building")
SAVE_EVERY = 10
#: The chaos job's in-memory snapshots: every 3 steps, so that restarts resume from
#: snapshots and from backups alike.
SNAPSHOT_EVERY = 3
# The faults that strike at the how-manieth snapshot of the attempt.
_IN_SNAPSHOT = ("kill_in_snapshot", "torn_snapshot")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault of a trial.

    Attributes:
        kind: One of `FAULT_KINDS`.
        attempt: The launcher's attempt (0, 1, ...) in which it strikes.
        worker: The worker that suffers it.
        step: The training step of that attempt after which it strikes (for
            "kill_in_write", "kill_in_collective" and the snapshot faults: the
            how-manieth write, collective or snapshot of the attempt).
        detail: "startup": "<phase>/<kill|stop>". Defaults to "".
    """

    kind: str
    attempt: int
    worker: int
    step: int
    detail: str = ""

    def __str__(self) -> str:
        where = {"kill_in_write": f"backup write {self.step}",
                 "kill_in_collective": f"collective {self.step}",
                 "kill_in_snapshot": f"snapshot {self.step}",
                 "torn_snapshot": f"snapshot {self.step}",
                 "startup": self.detail}.get(self.kind, f"step {self.step}")
        return f"{self.kind} (worker {self.worker}, attempt {self.attempt}, {where})"


def draw(rng: random.Random, kinds=FAULT_KINDS) -> list[Fault]:
    """One or two faults for a trial of the chaos job (`tf_distrib.chaos.job`, 96 steps).

    Faults that end an attempt take attempts 0, 1, ... in turn, within its first 64
    (attempt 0) or 20 trained steps, so that each finds the steps to strike in; a full
    disk strikes in the attempt after them, which runs to the end.

    Args:
        rng: The generator to draw with (seeded: the same seed, the same faults).
        kinds: The kinds to draw from. Defaults to `FAULT_KINDS`.
    """
    chosen = rng.sample(list(kinds), rng.choice([1, 2]) if len(kinds) > 1 else 1)
    faults, attempt = [], 0
    for kind in sorted(chosen, key=lambda k: k == "full_disk"):
        worker, step, detail = rng.randrange(2), rng.randint(2, 64 if attempt == 0 else 20), ""
        if kind == "startup":
            step, detail = 0, f"{rng.choice(STARTUP_PHASES)}/{rng.choice(['kill', 'stop'])}"
        elif kind == "kill_in_write":
            worker, step = 0, rng.randint(1, 3)  # the chief writes
        elif kind in _IN_SNAPSHOT:
            step = max(1, step // SNAPSHOT_EVERY)
        elif kind == "full_disk":
            worker, step = 0, rng.randint(1, 15)
        faults.append(Fault(kind, attempt, worker, step, detail))
        attempt += kind in RESTARTING
    return faults


def inject(faults: list[Fault], attempt: int, worker: int, backup_dir: str) -> list:
    """Arms this worker's faults for this attempt; returns the Keras callbacks to add.

    Call it first thing in the worker (start-up faults hook the phases it reports);
    the callbacks go after `BackupAndRestore`.
    """
    mine = [f for f in faults if f.attempt == attempt and f.worker == worker]
    callbacks = []
    for fault in mine:
        if fault.kind == "startup":
            phase, action = fault.detail.split("/")
            signal_on_entering(phase, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        elif fault.kind == "kill_in_write":
            _kill_in_write(fault.step)
        elif fault.kind == "kill_in_collective":
            _kill_in_collective(fault.step)
        elif fault.kind in _IN_SNAPSHOT:
            _kill_in_snapshot(fault.step, torn=fault.kind == "torn_snapshot")
        else:
            callbacks.append(_at_step(fault, backup_dir))
    return callbacks


def _signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)


def signal_on_entering(phase: str, sig: int) -> None:
    """Sends this process `sig` as it enters start-up `phase` (`tf_distrib.health.phases`).

    At once for "starting"; for "cluster", half a second in, while TensorFlow's
    rendezvous waits for the other workers.
    """
    from tf_distrib.health import phases

    if phase == phases.STARTING:
        _signal_self(sig)
    enter = phases.enter

    def enter_then_fault(entered):
        enter(entered)
        if entered == phase == phases.CLUSTER:
            threading.Timer(0.5, _signal_self, (sig,)).start()  # inside the rendezvous
        elif entered == phase:
            _signal_self(sig)

    phases.enter = enter_then_fault


def _kill_in_write(nth: int) -> None:
    """SIGKILL on the `nth` backup write, once its state file is durable and before its
    manifest exists: the backup must not count."""
    from tf_distrib.callbacks import backup_store

    open_for_writing, manifests = backup_store._open_for_writing, []

    def open_then_kill(path, size):
        if "/manifest.json" in path:
            manifests.append(path)
            if len(manifests) == nth:
                _signal_self(signal.SIGKILL)
        return open_for_writing(path, size)

    backup_store._open_for_writing = open_then_kill


def _kill_in_snapshot(nth: int, torn: bool) -> None:
    """SIGKILL in the `nth` in-memory snapshot: halfway through its copy, or (`torn`)
    once it is copied and before it is committed. The previous one must be used."""
    from tf_distrib.callbacks import memory_snapshot

    copy, commit, copies = memory_snapshot._copy, memory_snapshot._commit, []

    def copy_then_kill(sizes, read, low, target):
        copies.append(None)
        if len(copies) == nth and not torn:
            copy(sizes, read, low, target[:target.size // 2])
            _signal_self(signal.SIGKILL)
        copy(sizes, read, low, target)

    def kill_then_commit(*args):
        if len(copies) == nth and torn:
            _signal_self(signal.SIGKILL)
        commit(*args)

    memory_snapshot._copy, memory_snapshot._commit = copy_then_kill, kill_then_commit


def _kill_in_collective(nth: int) -> None:
    """SIGKILL a moment into the `nth` all-reduce of the gradient transport, counting the
    Python path's calls and the native ops' runs alike."""
    from tf_distrib.transport.collective import Transport
    from tf_distrib.transport.native_exchange import NativeExchange
    from tf_distrib.transport.native_sum import NativeSum

    calls = []

    def count() -> None:
        calls.append(None)
        if len(calls) == nth:
            threading.Timer(0.001, _signal_self, (signal.SIGKILL,)).start()

    python_path = Transport.all_reduce

    def all_reduce_then_kill(self, *args, **kwargs):
        count()
        return python_path(self, *args, **kwargs)

    def counted(native_op):
        def native_then_kill(self, ticket, tensors):
            import numpy as np
            import tensorflow as tf

            # The op runs in C++: a numpy_function just before it counts each of its runs.
            counter = tf.numpy_function(lambda: np.int64(count() or 0), [], tf.int64,
                                        stateful=True)
            with tf.control_dependencies([counter]):
                return native_op(self, tf.identity(ticket), tensors)
        return native_then_kill

    Transport.all_reduce = all_reduce_then_kill
    NativeSum.all_reduce = counted(NativeSum.all_reduce)
    NativeExchange.all_reduce = counted(NativeExchange.all_reduce)


def _at_step(fault: Fault, backup_dir: str):
    import keras

    filler = os.path.join(os.path.dirname(backup_dir), "filler")

    class AtStep(keras.callbacks.Callback):
        """Strikes after the `fault.step`-th step this attempt trains (not counting the
        steps a resumed epoch replays). Goes after BackupAndRestore in `callbacks`: a
        full disk lasts from after one step's save until the next save has failed."""


        def on_train_begin(self, logs=None):
            self.trained, self.full_until = 0, None
            self.last = int(self.model.optimizer.iterations.numpy())  # restored by now

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step == self.last:
                return  # a replayed step
            self.trained, self.last = self.trained + 1, step
            # Space again halfway to the save after the failed one (an asynchronous save
            # fails a moment after its step).
            if self.full_until is not None and step >= self.full_until + SAVE_EVERY // 2:
                os.remove(filler)
                self.full_until = None
            if self.trained != fault.step:
                return
            if fault.kind == "full_disk":
                fill(filler)
                self.full_until = (step // SAVE_EVERY + 1) * SAVE_EVERY  # the next save
            else:
                _signal_self({"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP,
                              "sigterm": signal.SIGTERM}[fault.kind])

    return AtStep()


def fill(path: str) -> None:
    """Writes the file `path` until its file system is full (ENOSPC), at most 1 GiB."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for _ in range(1 << 18):
            os.write(fd, bytes(4096))
    except OSError:
        pass  # full
    finally:
        os.close(fd)
