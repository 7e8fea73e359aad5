"""BackupAndRestore: fault-tolerant training that resumes exactly where it stopped."""

from __future__ import annotations

import hashlib
import os
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_distrib import _compat, cluster, contract, data
from tf_distrib._checks import check_int, is_int
from tf_distrib.callbacks import shared_directory, snapshot_peers, worker_state
from tf_distrib.callbacks.background_save import BackgroundSave
from tf_distrib.callbacks.backup_store import BackupStore
from tf_distrib.callbacks.host_snapshot import HostSnapshot
from tf_distrib.callbacks.memory_snapshot import MemorySnapshot
from tf_distrib.callbacks.preemption import PreemptionWatcher
from tf_distrib.callbacks.snapshot_cadence import SnapshotCadence
from tf_distrib.contract import PREEMPTED_EXIT_CODE
from tf_distrib.health import phases, steps, watchdog


class BackupAndRestore(keras.callbacks.Callback):
    """Backs training up regularly and resumes from the newest valid backup.

    A drop-in replacement for `keras.callbacks.BackupAndRestore` that works with
    `model.fit` under no strategy, MirroredStrategy and MultiWorkerMirroredStrategy:

    - **What is saved**: every model variable (weights and RNG seed state), every
      optimizer variable (slots, iterations), the metrics' accumulators, the epoch
      and the step within it.
    - **Multi-worker safe**: every worker takes part in a save (reading the metrics
      sums them across workers) and only the chief writes it; all workers share one
      `backup_dir`, which `fit` checks at its start: a directory some worker cannot see
      (a path on each host's own disk) raises ValueError naming the workers.
    - **Asynchronous** (`async_save=True`): the training thread only copies the
      state into host memory kept from one save to the next (529 MB take about
      0.03 s); the checksum, the write (on a local disk, past the page cache) and
      the atomic rename happen on a background thread. Host memory: one more copy
      of the state, mapped in the background after the first step of the first
      `fit`; after `fit` it stays with the process for the next `fit`, as memory the
      kernel takes back whenever it needs it (MADV_FREE, where the platform has
      it). At most one save is in flight: a save that comes due while the
      previous one is still being written waits for it (and says how long, when
      `verbose`). The end of `fit`, a preemption and the exit of the process wait
      for the backup in flight; a backup is listed only once it is complete.
    - **Atomic and verified**: a backup's manifest, with the CRC-32 of its state, is
      written last and renamed into place: the backup exists from that moment, on
      local disks and object stores (gs://) alike. On restore the newest backup that
      verifies is used; incomplete or broken ones are skipped with a warning, and when
      none is usable training starts afresh with a warning.
    - **Exact mid-epoch resume**: the resumed run skips exactly the steps already
      done in the interrupted epoch (their batches are drawn, not trained on) and
      restores the metrics, so with `keras.utils.set_random_seed` and
      `tf.config.experimental.enable_op_determinism()` the final weights are bitwise
      those of an uninterrupted run. This needs the dataset to yield the same batches
      for an epoch in a fresh process as in the original one: unshuffled data, or
      shuffling with a fixed seed and `reshuffle_each_iteration=False`.
    - **Preemption**: with `save_before_preemption=True`, a SIGTERM makes all
      workers save at the same step and exit with status `PREEMPTED_EXIT_CODE` (42);
      `tf-distrib launch` restarts them and they resume from that step.
    - **Gradient accumulation** (`gradient_accumulation_steps=K`): backups are made
      only at update steps, where no gradients wait in the accumulators, so a backup
      does not depend on the number of workers and a run killed between micro-steps
      resumes bitwise from the last update. A save that comes due between
      micro-steps (save_freq, an epoch end, preemption) is made at the next update.
    - **Storage faults**: a save that fails (a full disk, a read-only or vanished
      directory, a permission error) or takes longer than `save_timeout` (stalled
      storage) is reported with a warning naming the path and the cause, what it
      left behind is deleted, the previous backup stays the newest, and training goes
      on. After `max_failed_saves` failed saves in a row, `fit` raises `BackupError`.
      A backup directory that disappears while training is made again, with a warning.
    - **In-memory snapshots** (under `tf-distrib launch`): besides the backups, the
      newest state (weights, optimizer, RNG, step; not the metrics) is copied as
      often as `snapshot_freq` says into shared memory that the launcher owns and
      frees (`memory_snapshot`): a restarted group resumes from the newest one any
      host holds when it is newer than the newest backup, and loses at most the
      steps since it; a host that lost its memory gets it from a peer
      (`snapshot_peers`). Each of a host's workers copies an equal share; a host
      holds at most 2x the state. A snapshot is not durable: the backups stay.
      Under PowerSGD they are off (they do not hold its per-worker residuals).
    - **Per-worker state**: what the gradient all-reduce keeps per worker (PowerSGD's
      residuals) is saved as one row per worker (`worker_state`); each worker gets its
      row back, so a resumed PowerSGD run stays bitwise equal to an uninterrupted one.
    - **Hang watchdog**: the chief's write pauses `tf_distrib.health.watchdog`; the
      collective reads of a save stay watched.

    Args:
        backup_dir: Directory for the backups, shared by all workers (local path or
            any `tf.io.gfile` scheme, e.g. gs://).
        save_freq: "epoch" to back up at the end of every epoch, or a positive int N
            to also back up every N training steps. Defaults to "epoch".
        delete_checkpoint: Delete the backups when training finishes normally (and
            so make none after the last step). They are gone from the directory's
            listing when `fit` returns, and their files are deleted in the
            background. Defaults to True.
        keep: How many of the newest backups to keep. Defaults to 2.
        save_before_preemption: Save and exit on SIGTERM. Defaults to True.
        verbose: Print a line when training resumes, is preempted, or waits for a
            backup still being written. Defaults to 1.
        async_save: Write backups on a background thread (its cost:
            docs/performance.md). Defaults to True.
        save_timeout: Seconds a save may take before it counts as failed (storage
            that stalls); the write goes on in the background. Defaults to 300.
        max_failed_saves: Failed saves in a row after which `fit` raises
            `BackupError`. Defaults to 3.
        snapshot_freq: In-memory snapshots, where the launcher keeps them: "auto"
            (every step, or every few steps where a copy would take more than 3% of
            the step time: `snapshot_cadence`), a number of steps, or None for none.
            Defaults to "auto".

    Attributes:
        restored_step: The global step training resumed from in the last `fit`, or
            None when it started afresh.

    Example:

    ```python
    model.fit(dataset, epochs=10, callbacks=[
        td.callbacks.BackupAndRestore("/shared/backup", save_freq=100)])
    ```
    """

    def __init__(self, backup_dir: str, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, *, keep: int = 2,
                 save_before_preemption: bool = True, verbose: int = 1,
                 async_save: bool = True, save_timeout: float = 300.0,
                 max_failed_saves: int = 3, snapshot_freq: str | int | None = "auto"):
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore needs a backup_dir, e.g. '/tmp/backup'.")
        if save_freq != "epoch" and (not is_int(save_freq) or save_freq < 1):
            raise ValueError(
                f"save_freq must be 'epoch' or a positive number of steps, got {save_freq!r}.")
        if snapshot_freq not in ("auto", None) and (not is_int(snapshot_freq)
                                                    or snapshot_freq < 1):
            raise ValueError(f"snapshot_freq must be 'auto', a positive number of steps or "
                             f"None (no in-memory snapshots), got {snapshot_freq!r}.")
        check_int("keep", keep)
        check_int("max_failed_saves", max_failed_saves)
        if not (isinstance(save_timeout, (int, float)) and save_timeout > 0):
            raise ValueError(f"save_timeout must be a number of seconds > 0, got "
                             f"{save_timeout!r}.")
        self.backup_dir = str(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = save_before_preemption
        self.verbose = verbose
        self.async_save = async_save
        self.save_timeout = float(save_timeout)
        self.max_failed_saves = max_failed_saves
        self.snapshot_freq = snapshot_freq
        self._memory: MemorySnapshot | None = None
        self._cadence: SnapshotCadence | None = None
        # (specs of the state's arrays, {index: variable} of this worker's share of them)
        self._memory_share = None
        self._store = BackupStore(self.backup_dir, keep)
        self._writer = BackgroundSave(exit_wait=self.save_timeout)
        self._writing_step: int | None = None  # the step the writer's job saves, if any
        self._stalled = False  # that save ran past save_timeout (and was reported)
        self._newest_step: int | None = None  # the newest backup known to be complete
        self._failed_saves = 0
        self._snapshot = HostSnapshot()
        self._saved_step: int | None = None
        self._preemption: PreemptionWatcher | None = None
        self._global_step = 0
        self._epoch = 0
        self._step_in_epoch = 0
        self._skip = 0
        self._skipped_last_call = False
        self._save_due = False
        self.restored_step: int | None = None

    # Keras hooks -----------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._failed_saves = 0
        self._finish_job()  # a backup a failed fit left in flight
        self._newest_step = None  # until a restore finds one
        strategy = self.model.distribute_strategy
        self._is_chief = strategy.extended.should_checkpoint
        self._global_step = self._epoch = self._step_in_epoch = self._skip = 0
        self._skipped_last_call = self._save_due = False
        self.restored_step = self._saved_step = None
        multi_worker = _is_multi_worker(strategy)
        if multi_worker:
            shared_directory.check(self.backup_dir, strategy)
        self._open_memory(strategy, multi_worker)
        with phases.entered(phases.RESTORING):
            restored = self._store.read_latest()
            if restored is not None:
                self._saved_step = self._newest_step = restored[0]["step"]
            snapshot = self._newest_snapshot(restored, strategy, multi_worker)
            if snapshot is not None:
                self._restore(*snapshot, from_memory=True)
            elif restored is not None:
                self._restore(*restored)
        if self.save_before_preemption:
            self._preemption = PreemptionWatcher(
                cluster.spec_of(strategy) if _is_multi_worker(strategy) else None,
                model=self.model)

    def _open_memory(self, strategy, multi_worker: bool) -> None:
        """Opens this host's in-memory snapshots, where the launcher keeps them."""
        directory = contract.snapshot_dir()
        self._memory_share = None
        if directory is None or self.snapshot_freq is None:
            self._memory = self._cadence = None
            return
        if worker_state.kept(strategy):
            self._memory = self._cadence = None
            if self.verbose and (not multi_worker or cluster.spec_of(strategy).is_chief):
                print("BackupAndRestore: in-memory snapshots are off: they do not hold "
                      "PowerSGD's per-worker error feedback; the backups have it.", flush=True)
            return
        part, parts = contract.local_workers()
        # One subdirectory per backup_dir: another BackupAndRestore's state is not this one's.
        key = hashlib.sha1(os.path.abspath(self.backup_dir).encode()).hexdigest()[:16]
        os.makedirs(os.path.join(directory, key), exist_ok=True)
        self._memory = MemorySnapshot(os.path.join(directory, key), part, parts)
        self._cadence = SnapshotCadence(
            self.snapshot_freq, strategy, multi_worker,
            verbose=self.verbose > 0 and (not multi_worker or cluster.spec_of(strategy).is_chief))

    def _newest_snapshot(self, durable, strategy, multi_worker: bool):
        """(manifest, arrays) of the newest in-memory snapshot of any host, if newer than
        `durable`; a host that lacks it gets it from one that holds it (`snapshot_peers`)."""
        if self._memory is None:
            return None
        peers = strategy if multi_worker else None
        step, holders = snapshot_peers.newest(peers, f"{self._cadence.key}/steps",
                                              self._memory.steps(), self.save_timeout)
        if step is None or (durable is not None and durable[0]["step"] >= step):
            return None
        mine = self._memory.read(step) if holders[_task_number(peers)] else None
        if all(holders):
            return mine
        return snapshot_peers.share(peers, f"{self._cadence.key}/{step}", mine, holders,
                                    self.save_timeout)

    def _restore(self, manifest, arrays, from_memory: bool = False):
        """Resumes from a backup or an in-memory snapshot: fit's first epoch now, the
        state now or at the first step."""
        meta = manifest["metadata"]
        epoch, step = meta["epoch"], meta["step_in_epoch"]
        if step and meta.get("steps_per_epoch") and step >= meta["steps_per_epoch"]:
            epoch, step = epoch + 1, 0
        # fit() reads this right after on_train_begin to choose its first epoch.
        _compat.set_initial_epoch(self.model, epoch)
        self._global_step = self.restored_step = manifest["step"]
        worker_state.restore(self.model.distribute_strategy, self.model.optimizer, arrays)
        # A snapshot holds no metrics (reading them is a collective): they restart at 0.
        deferred = ["metrics"] if step and not from_memory else []
        if self.model.built:
            if not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)
            self._assign(manifest, arrays, ["model", "optimizer"])
        else:
            deferred = ["model", "optimizer"] + deferred
        self._wrap_train_function(manifest, arrays, step, deferred)
        if self.verbose:
            source = " (in-memory snapshot)" if from_memory else ""
            print(f"BackupAndRestore: resuming from step {manifest['step']}{source} "
                  f"(epoch {epoch}, step {step} within it)", flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        # The epoch's shuffle order follows from its number, in a resumed process too.
        data.set_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._skipped_last_call:
            return
        steps = self.model.steps_per_execution
        self._step_in_epoch = batch + 1
        self._global_step += steps
        if self.async_save and self._is_chief and (
                self._global_step == (self.restored_step or 0) + steps):
            self._map_host_memory()  # after the first step: Keras builds some state in it
        # With steps_per_execution > 1 the step count can jump over a multiple.
        if (self.save_freq != "epoch"
                and self._global_step // self.save_freq
                > (self._global_step - steps) // self.save_freq):
            self._save_due = True
        if self._cadence is not None and self._cadence.due(self._global_step, steps) \
                and self._at_update_boundary():
            self._snapshot_in_memory()
        if self._preemption is not None:
            stop_at = self._preemption.stop_step(self._global_step)
            if (stop_at is not None and self._global_step >= stop_at
                    and self._at_update_boundary()):
                self._save()
                self._finish_job()
                # The SIGTERM handler stays installed: the launcher may signal this
                # process again while it exits, and the default action would kill it.
                if self.verbose:
                    print(f"BackupAndRestore: preempted (SIGTERM); saved at step "
                          f"{self._global_step}, exiting with status {PREEMPTED_EXIT_CODE}",
                          flush=True)
                raise SystemExit(PREEMPTED_EXIT_CODE)
        if self._save_due and self._at_update_boundary() and not self._deleted_at_once(
                self._epoch, batch + 1 == self.params.get("steps")):
            self._save()

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._step_in_epoch = epoch + 1, 0
        self._save_due = True
        if self._at_update_boundary() and not self._deleted_at_once(epoch, True):
            self._save()

    def on_train_end(self, logs=None):
        self._finish_job()
        self._snapshot.release()
        if self._memory is not None:
            self._close_memory()
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        _compat.set_initial_epoch(self.model, None)
        if self.delete_checkpoint and self._is_chief and not self._writer.busy:
            self._store.retire_all()  # a later fit on this directory starts afresh
            self._writer.start(self._store.purge_retired,
                               f"deleting the backups in {self.backup_dir}")

    # Save and restore ------------------------------------------------------------

    def _variables(self):
        return {"model": self.model.variables, "optimizer": self.model.optimizer.variables,
                "metrics": self.model.metrics_variables}

    def _named_variables(self):
        """(name, variable) for every saved variable, in the backup's order."""
        return [(f"{group}/{i}", v) for group, variables in self._variables().items()
                for i, v in enumerate(variables)]

    def _map_host_memory(self) -> None:
        """Maps the memory saves copy into, off the training thread (see HostSnapshot)."""
        if self._writer.busy:  # a stalled save from an earlier fit
            return
        specs = [(name, v.shape, tf.as_dtype(v.dtype).as_numpy_dtype)
                 for name, v in self._named_variables()]
        self._writer.start(lambda: self._snapshot.allocate(specs),
                           "mapping host memory for backups")

    def _at_update_boundary(self) -> bool:
        """Whether no gradients wait in accumulators (`gradient_accumulation_steps`).

        Backups are made only there, so they hold no half-accumulated gradients: a
        backup is the same whatever the number of workers, and a run interrupted
        between micro-steps resumes from the last update, bitwise. A save due between
        micro-steps (save_freq, epoch end, preemption) waits for the next update step.
        """
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        return not steps or self._global_step % steps == 0

    def _deleted_at_once(self, epoch: int, last_step_of_epoch: bool) -> bool:
        """Whether a backup made now would be deleted when `fit` ends, right after.

        With `delete_checkpoint`, the backup after the last step of the last epoch
        would only cost a save (and, asynchronously, a wait at the end of `fit`).
        """
        return (self.delete_checkpoint and last_step_of_epoch
                and epoch + 1 == self.params.get("epochs"))

    def _snapshot_in_memory(self) -> None:
        """Copies this worker's share of the state (no metrics) into the host's snapshot.

        On the training thread: a copy in the background measured no cheaper on busy
        cores, and would let a kill right after a step lose that step's snapshot."""
        began = time.perf_counter()
        if self._memory_share is None:
            variables = [(name, v) for name, v in self._named_variables()
                         if not name.startswith("metrics/")]
            specs = [(name, tf.as_dtype(v.dtype).as_numpy_dtype, tuple(v.shape))
                     for name, v in variables]
            self._memory_share = (specs, {i: variables[i][1]
                                          for i in self._memory.indices(specs)})
        specs, share = self._memory_share
        try:
            self._memory.write(self._global_step, {
                "epoch": self._epoch, "step_in_epoch": self._step_in_epoch,
                "steps_per_epoch": self.params.get("steps")}, specs,
                lambda i: _compat.local_value(share[i]))
        except OSError as e:  # /dev/shm is full
            self._close_memory(error=e)
            return
        self._cadence.copied(time.perf_counter() - began)

    def _close_memory(self, error: OSError | None = None) -> None:
        """Closes the in-memory snapshots; `error` turns them off with a warning."""
        if error is not None:
            warnings.warn(f"BackupAndRestore: in-memory snapshots are off for this fit: "
                          f"{error}. The backups go on.", RuntimeWarning, stacklevel=3)
        self._memory.close(delete=self.delete_checkpoint or error is not None)
        self._memory = self._cadence = self._memory_share = None

    def _save(self):
        began = time.time()
        try:
            self._take_backup()
        finally:
            recorder = steps.recorder_of(self.model.distribute_strategy)
            if recorder is not None:  # what training waited for, on the step timeline
                recorder.add_span("backup", "backup", began, time.time(), blocked=True)

    def _take_backup(self):
        self._save_due = False
        if self._global_step == self._saved_step:  # batch end and epoch end of one step
            return
        self._saved_step = step = self._global_step
        # convert_to_tensor also reads metrics' SyncOnRead variables (summed over replicas
        # and workers: every worker takes part), which keras.ops.convert_to_numpy cannot.
        # Those are collectives: the watchdog keeps watching them (a stuck peer).
        values = [(name, tf.convert_to_tensor(v.value)) for name, v in self._named_variables()]
        per_worker = worker_state.gather(self.model.distribute_strategy, self.model.optimizer)
        if not self._is_chief:
            return
        with watchdog.paused("saving a backup"):
            metadata = {"epoch": self._epoch, "step_in_epoch": self._step_in_epoch,
                        "steps_per_epoch": self.params.get("steps")}
            # np.asarray views a CPU tensor's buffer (read-only; .numpy() copies it).
            arrays = [(name, np.asarray(t)) for name, t in values] + per_worker
            what = self._writer.what
            waited = self._finish_job()  # its buffers are the ones copied into next
            if self._writer.busy:  # stalled past save_timeout, and still holds them
                self._save_failed(step, f"{what} is still stalled after "
                                        f"{time.monotonic() - self._writer.started_at:.0f} s")
                return
            if self.async_save:
                # The copy, not the tensors: TensorFlow copies a variable before updating
                # it while a read of it lives, into fresh memory each time (HostSnapshot).
                arrays = self._snapshot.copy(arrays)
            self._writing_step = step
            self._writer.start(lambda: self._write(step, arrays, metadata),
                               f"writing the backup of step {step} to {self.backup_dir}")
            if not self.async_save:
                self._finish_job()
            elif waited > 0.1 and self.verbose:
                print(f"BackupAndRestore: waited {waited:.1f} s for {what} before the backup "
                      f"of step {step}", flush=True)

    def _write(self, step: int, arrays, metadata: dict) -> None:
        """The writer's job: one backup (off the training thread, even when synchronous)."""
        if self._newest_step is not None and not tf.io.gfile.exists(self.backup_dir):
            warnings.warn(f"BackupAndRestore: the backup directory {self.backup_dir} has "
                          "disappeared since the last backup (deleted, or its file system "
                          "unmounted), with the backups in it; making it again.",
                          RuntimeWarning, stacklevel=1)
        began = time.time()
        self._store.write(step, arrays, metadata)
        recorder = steps.recorder_of(self.model.distribute_strategy)
        if recorder is not None:
            recorder.add_span(f"writing the backup of step {step}", "backup", began, time.time())

    def _finish_job(self) -> float:
        """Waits for the writer's job, a save at most until its `save_timeout`.

        A save that failed or stalled is reported (`_save_failed`) once; a stalled one
        is not waited for again, and its late result is taken when its thread ends.
        Another job's failure (mapping memory, deleting backups) is a warning.
        Returns the seconds waited.
        """
        step = self._writing_step
        if self._stalled and self._writer.busy:
            return 0.0
        timeout = None
        if step is not None and not self._stalled:
            timeout = max(0.0, self._writer.started_at + self.save_timeout - time.monotonic())
        start = time.monotonic()
        try:
            self._writer.wait(timeout)
        except TimeoutError:
            self._stalled = True
            self._save_failed(step, f"it stalled: still running after {self.save_timeout:g} s "
                                    "(save_timeout)")
        except RuntimeError as e:
            cause, stalled = e.__cause__ or e, self._stalled
            self._writing_step, self._stalled = None, False
            if step is None:
                warnings.warn(f"BackupAndRestore: {self._writer.what} failed: {cause}",
                              RuntimeWarning, stacklevel=2)
            else:
                self._store.discard_incomplete(step)
                if not stalled:  # a stalled save was reported when it stalled
                    self._save_failed(step, str(cause))
        else:
            if step is not None:
                self._newest_step, self._failed_saves = step, 0
            self._writing_step, self._stalled = None, False
        return time.monotonic() - start

    def _save_failed(self, step: int, cause: str) -> None:
        """Warns that the backup of `step` failed, or raises BackupError after too many."""
        self._failed_saves += 1
        newest = ("no backup was made before it" if self._newest_step is None else
                  f"the backup of step {self._newest_step} stays the newest")
        message = (f"BackupAndRestore: the backup of step {step} to {self.backup_dir} failed: "
                   f"{cause}; {newest}.")
        if self._failed_saves >= self.max_failed_saves:
            raise BackupError(
                f"{message} {self._failed_saves} saves failed in a row (max_failed_saves="
                f"{self.max_failed_saves}): training stops. Fix the storage (space, "
                "permissions, the mount), then start again: training resumes from the "
                "newest backup.")
        warnings.warn(f"{message} Training goes on ({self._failed_saves} of "
                      f"{self.max_failed_saves} failed saves in a row before it stops).",
                      RuntimeWarning, stacklevel=3)

    def _wrap_train_function(self, manifest, arrays, step: int, deferred: list[str]) -> None:
        """Assigns `deferred` state on the first training call, then skips `step` steps.

        Without a strategy Keras builds the metrics (and an unbuilt model) on the first
        step, so their state can only be assigned once the data's spec is known. The
        skipped steps draw their batches without training on them and report the
        restored metrics as their logs.
        """
        train_function = self.model.train_function
        per_call = self.model.steps_per_execution
        self._skip = step // per_call

        def restore_skip_then_train(iterator):
            if deferred:
                _compat.build_for_data(self.model, iterator.element_spec)
                self._assign(manifest, arrays, deferred)
                deferred.clear()
            self._skipped_last_call = self._skip > 0
            if self._skipped_last_call:
                for _ in range(per_call):
                    next(iterator)
                self._skip -= 1
                # Other callbacks see the logs as they were at the backup.
                return self.model.get_metrics_result()
            self.model.train_function = train_function
            return train_function(iterator)

        self.model.train_function = restore_skip_then_train

    def _assign(self, manifest, arrays, restoring: list[str]) -> None:
        groups = self._variables()
        # Matched by position, like Keras' own checkpoints: variable names carry
        # per-process counters ("dense_1") that change when a model is rebuilt.
        problems = []
        for group in restoring:
            saved = sum(1 for name in arrays if name.startswith(f"{group}/"))
            if saved != len(groups[group]):
                problems.append(f"{saved} {group} variables saved, {len(groups[group])} now")
                continue
            for i, variable in enumerate(groups[group]):
                value = arrays[f"{group}/{i}"]
                if value.shape != tuple(variable.shape) or value.dtype != variable.dtype:
                    problems.append(f"{variable.path}: saved {value.dtype}{list(value.shape)}, "
                                    f"now {variable.dtype}{list(variable.shape)}")
        if problems:
            raise ValueError(
                f"BackupAndRestore: the backup in {self.backup_dir} (step {manifest['step']}) "
                f"was made for another model or optimizer: {'; '.join(problems[:3])}. Use a "
                "new backup_dir, or delete the old backups.")
        for group in restoring:
            for i, variable in enumerate(groups[group]):
                variable.assign(arrays[f"{group}/{i}"])


class BackupError(RuntimeError):
    """`max_failed_saves` backups in a row failed: training stops rather than go on unprotected."""


def _is_multi_worker(strategy) -> bool:
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and _compat.in_multi_worker_mode(strategy))


def _task_number(strategy) -> int:
    """This worker's position among the training tasks (0 without a multi-worker strategy)."""
    if strategy is None:
        return 0
    spec = cluster.spec_of(strategy)
    return spec.training_index
