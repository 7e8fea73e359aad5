"""BackupAndRestore with real crashes (SIGKILL), real SIGTERM and real files."""

import hashlib
import json
import mmap
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_distrib as td
from tests._training import train_with_backup
from tf_distrib.callbacks import PREEMPTED_EXIT_CODE
from tf_distrib.launch import launch
from tf_distrib.testing import run_workers


def assert_bitwise_equal(a, b):
    assert a["iterations"] == b["iterations"]
    assert len(a["weights"]) == len(b["weights"])
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        np.testing.assert_array_equal(wa, wb)


@pytest.fixture(scope="module")
def one_worker_reference(tmp_path_factory):
    """`train_with_backup` in one worker without a strategy, uninterrupted."""
    [reference] = run_workers(train_with_backup, 1, args=(str(tmp_path_factory.mktemp("ref")),),
                              startup_timeout=None, quiet=True)
    return reference


@pytest.mark.parametrize("logical_cpus", [None, 4], ids=["no strategy", "mirrored x4"])
@pytest.mark.multiprocess
def test_mid_epoch_crash_resumes_bitwise_exactly(tmp_path, logical_cpus, request):
    # 1024 examples / 32 = 32 steps per epoch; SIGKILL at step 45 (epoch 1, step 13)
    # once the backup of step 40 is written (in the background: on a loaded machine it
    # was not, 5 steps later, and the job resumed from step 32), so 8 steps of epoch 1
    # are skipped on resume. No in-memory snapshots: the backups' path.
    if logical_cpus is None:
        reference = request.getfixturevalue("one_worker_reference")
    else:
        [reference] = run_workers(train_with_backup, 1, args=(str(tmp_path / "ref"),),
                                  kwargs={"logical_cpus": logical_cpus}, quiet=True)
    result = launch(train_with_backup, 1, args=(str(tmp_path / "b"),),
                    kwargs={"logical_cpus": logical_cpus, "kill_at": 45,
                            "kill_when_saved": True, "snapshot_freq": None}, max_restarts=1,
                    startup_timeout=None, quiet=True, timeout=240)
    assert result.exit_code == 0, result.failure_report()
    assert result.exit_codes[0] == [-9]
    resumed = result.values[0]
    assert resumed["restored_step"] == 40
    assert_bitwise_equal(resumed, reference.value)
    assert resumed["iterations"] == 96
    # The interrupted epoch's logged loss is exact too (metrics are restored).
    np.testing.assert_array_equal(resumed["loss"], reference.value["loss"][1:])


@pytest.mark.parametrize("repeat", [False, True], ids=["iterator per epoch", "repeat"])
@pytest.mark.multiprocess
def test_a_shuffled_epoch_resumes_in_its_own_order_on_two_workers(tmp_path, repeat):
    # Shuffled every epoch: the resumed epoch 1 must read epoch 1's order, not the first
    # order a fresh process would draw. No in-memory snapshots: the backups' path.
    kwargs = {"shuffle_buffer": 1024, "repeat": repeat}
    reference = run_workers(train_with_backup, 2, args=(str(tmp_path / "ref"),),
                            kwargs=kwargs, quiet=True)
    result = launch(train_with_backup, 2, args=(str(tmp_path / "b"),),
                    kwargs={**kwargs, "kill_at": 45, "kill_worker": 1, "snapshot_freq": None},
                    max_restarts=1, quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    assert [w.value["restored_step"] for w in result.workers] == [40, 40]
    for worker, ref in zip(result.workers, reference, strict=True):
        assert_bitwise_equal(worker.value, ref.value)
    # The interrupted epoch's logged mean loss may differ in its last bit (the weights do
    # not); unshuffled it is exact (test_mid_epoch_crash_resumes_bitwise_exactly).
    np.testing.assert_allclose(result.values[0]["loss"], reference[0].value["loss"][1:],
                               rtol=1e-6)


@pytest.mark.multiprocess
def test_killed_while_a_backup_is_written_resumes_from_the_previous_one(tmp_path,
                                                                       one_worker_reference):
    reference = one_worker_reference
    # The backup of step 20 stops for a minute after its first array, in the background;
    # training goes on and the process is killed at step 22, in the middle of that write.
    result = launch(train_with_backup, 1, args=(str(tmp_path / "b"),),
                    kwargs={"kill_at": 22, "slow_saves": {20: 60}, "snapshot_freq": None},
                    max_restarts=1,
                    startup_timeout=None, quiet=True, timeout=240)
    assert result.exit_code == 0, result.failure_report()
    assert result.exit_codes[0] == [-9]
    resumed = result.values[0]
    assert resumed["restored_step"] == 10
    assert_bitwise_equal(resumed, reference.value)
    # The cut write had no manifest: skipped with a warning, the previous backup used.
    assert "backup-000000000020 is unusable (no manifest.json)" in "".join(
        result.workers[0].output)


@pytest.fixture(scope="module")
def two_worker_reference(tmp_path_factory):
    backup_dir = str(tmp_path_factory.mktemp("reference"))
    workers = run_workers(train_with_backup, 2, args=(backup_dir,), quiet=True, timeout=240)
    assert_bitwise_equal(workers[0].value, workers[1].value)
    return workers[0].value


@pytest.mark.multiprocess
def test_two_workers_killed_mid_epoch_resume_from_memory_bitwise_exactly(tmp_path,
                                                                         two_worker_reference):
    backup_dir = tmp_path / "shared"
    result = launch(train_with_backup, 2, args=(str(backup_dir),),
                    kwargs={"kill_at": 45, "kill_worker": 1, "snapshot_freq": 1},
                    max_restarts=1, quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    assert result.exit_codes[0][1] == -9
    # The in-memory snapshot of step 45, the step before the kill: no step is lost
    # (the backup of step 40 is older).
    for worker in result.workers:
        assert worker.value["restored_step"] == 45
        assert_bitwise_equal(worker.value, two_worker_reference)
    assert "resuming from step 45 (in-memory snapshot)" in "".join(result.workers[0].output)
    # One shared directory holds only the chief's committed backups.
    assert sorted(os.listdir(backup_dir)) == ["backup-000000000090", "backup-000000000096"]


@pytest.mark.parametrize("transport", [None, "tf"], ids=["tf_distrib transport", "TF collective"])
@pytest.mark.multiprocess
def test_a_host_that_lost_its_memory_resumes_from_its_peers_snapshot(tmp_path, transport,
                                                                     two_worker_reference):
    # Each worker alone on its "host"; worker 1's snapshots are gone before the restart,
    # and there is no backup yet (the first is at the end of epoch 0, step 32).
    result = launch(train_with_backup, 2, args=(str(tmp_path / "shared"),),
                    kwargs={"kill_at": 20, "kill_worker": 1, "save_freq": "epoch",
                            "snapshot_freq": 1, "hosts_of_their_own": True,
                            "transport": transport},
                    max_restarts=1, quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    for worker in result.workers:
        assert worker.value["restored_step"] == 20
        assert_bitwise_equal(worker.value, two_worker_reference)


@pytest.mark.multiprocess
def test_sigterm_saves_all_workers_at_one_step_and_resumes(tmp_path, two_worker_reference):
    backup_dir = tmp_path / "shared"
    result = launch(train_with_backup, 2, args=(str(backup_dir),),
                    kwargs={"kill_at": 50, "kill_worker": 1, "kill_with": "SIGTERM",
                            "save_freq": 1000, "late_watcher": True},
                    max_restarts=1, quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    assert result.exit_codes[0] == [PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE]
    saved = [[line for line in w.output if "preempted (SIGTERM); saved at step" in line]
             for w in result.attempts[0].workers]
    assert all(len(lines) == 1 for lines in saved)
    step = int(saved[0][0].split("saved at step ")[1].split(",")[0])
    # SIGTERM after step 50 is seen at step 51, which announces 51 + a 1-step margin; worker
    # 0 reads it 2 s late, and still stops there (it once stepped on into a collective that
    # worker 1 never joined, until the launch timed out).
    assert saved[0][0] == saved[1][0] and 51 <= step <= 52
    for worker in result.workers:
        assert worker.value["restored_step"] == step
        assert_bitwise_equal(worker.value, two_worker_reference)


# In-process tests (the pytest process has 4 logical CPUs; these use no strategy).

def small_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def small_data():
    x = np.arange(64 * 4, dtype="float32").reshape(64, 4) / 256
    return tf.data.Dataset.from_tensor_slices((x, x[:, :3])).batch(8)  # 8 steps


def fit_with_backups(backup_dir, epochs=2, **kwargs):
    callback = td.callbacks.BackupAndRestore(str(backup_dir), save_freq=4,
                                             delete_checkpoint=False, **kwargs)
    small_model().fit(small_data(), epochs=epochs, verbose=0, callbacks=[callback])
    return callback


def newest(backup_dir):
    return sorted(p for p in os.listdir(backup_dir) if p.startswith("backup-"))[-1]


@pytest.mark.parametrize("damage", ["truncate", "delete state", "delete manifest", "flip bytes",
                                    "garbage manifest"])
def test_corrupt_newest_backup_falls_back_to_the_previous_one(tmp_path, damage):
    fit_with_backups(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["backup-000000000012", "backup-000000000016"]
    target = tmp_path / newest(tmp_path)
    state, manifest = target / "state.bin", target / "manifest.json"
    if damage == "truncate":
        state.write_bytes(state.read_bytes()[:-4])
    elif damage == "delete state":
        state.unlink()
    elif damage == "delete manifest":
        manifest.unlink()
    elif damage == "flip bytes":
        data = bytearray(state.read_bytes())
        data[5] ^= 0xFF
        state.write_bytes(bytes(data))
    else:
        manifest.write_text("{not json")
    with pytest.warns(UserWarning, match="backup-000000000016 is unusable"):
        callback = fit_with_backups(tmp_path, epochs=3)
    assert callback.restored_step == 12


def test_backups_in_format_1_with_a_sha256_are_still_read(tmp_path):
    fit_with_backups(tmp_path)
    target = tmp_path / newest(tmp_path)
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["format"] == 2 and "crc32" in manifest["files"]["state.bin"]
    state = (target / "state.bin").read_bytes()
    manifest["format"] = 1
    manifest["files"]["state.bin"] = {"bytes": len(state),
                                      "sha256": hashlib.sha256(state).hexdigest()}
    (target / "manifest.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fit_with_backups(tmp_path, epochs=3).restored_step == 16
    assert not [w for w in caught if "BackupAndRestore" in str(w.message)]


def test_all_backups_corrupt_starts_fresh_with_a_warning(tmp_path):
    fit_with_backups(tmp_path)
    for name in os.listdir(tmp_path):
        (tmp_path / name / "state.bin").write_bytes(b"garbage")
    with pytest.warns(UserWarning) as record:
        callback = fit_with_backups(tmp_path, epochs=1)
    messages = [str(w.message) for w in record if "BackupAndRestore" in str(w.message)]
    assert len([m for m in messages if "is unusable" in m]) == 2
    assert any("none of the 2 backup(s)" in m and "starts from scratch" in m for m in messages)
    assert callback.restored_step is None


def test_leftover_temporary_and_retired_files_are_ignored_then_deleted(tmp_path):
    # A killed writer's temporary files, and a backup a killed deletion left retired.
    for leftover in (".tmp-crashed-writer", ".retired-000000000008-killed"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "state.bin").write_bytes(b"partial")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fit_with_backups(tmp_path, epochs=1).restored_step is None
    assert not [w for w in caught if "BackupAndRestore" in str(w.message)]
    callback = td.callbacks.BackupAndRestore(str(tmp_path), save_freq=4)
    small_model().fit(small_data(), epochs=1, verbose=0, callbacks=[callback])
    callback._writer.wait()
    assert os.listdir(tmp_path) == [".tmp-crashed-writer"]


def test_delete_checkpoint_and_keep(tmp_path):
    callback = td.callbacks.BackupAndRestore(str(tmp_path), save_freq=2, keep=3)
    # The deletion at the end of fit takes until the test lets it go (a sleep would race
    # with a slow machine).
    ending, release = threading.Event(), threading.Event()
    retire_all, purge = callback._store.retire_all, callback._store.purge_retired
    callback._store.retire_all = lambda: (ending.set(), retire_all())
    callback._store.purge_retired = lambda: (ending.is_set() and release.wait(60), purge())
    small_model().fit(small_data(), epochs=1, verbose=0, callbacks=[callback])
    # Gone from the directory when fit returns, though their files are still being
    # deleted: a fit that follows at once starts afresh.
    assert callback._writer.busy and len(os.listdir(tmp_path)) == 3
    assert fit_with_backups(tmp_path, keep=3).restored_step is None
    assert len([p for p in os.listdir(tmp_path) if p.startswith("backup-")]) == 3
    release.set()
    callback._writer.wait()
    assert len(os.listdir(tmp_path)) == 3


def test_completed_training_still_restores_the_weights(tmp_path):
    fit_with_backups(tmp_path)
    model = small_model()
    callback = td.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    history = model.fit(small_data(), epochs=2, verbose=0, callbacks=[callback])
    assert callback.restored_step == 16 and history.history == {}
    assert int(model.optimizer.iterations.numpy()) == 16


def test_backup_of_another_model_is_refused(tmp_path):
    fit_with_backups(tmp_path)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(3)])
    other.compile("sgd", "mse")
    callback = td.callbacks.BackupAndRestore(str(tmp_path))
    with pytest.raises(ValueError, match="made for another model.*2 model variables saved, 4"):
        other.fit(small_data(), epochs=1, verbose=0, callbacks=[callback])


@pytest.mark.parametrize("save_freq", [0, False, True, -3, "batch", "steps", 2.5, None])
def test_save_freq_validation(save_freq):
    with pytest.raises(ValueError, match="'epoch' or a positive number of steps"):
        td.callbacks.BackupAndRestore("/tmp/x", save_freq=save_freq)


def test_other_argument_validation():
    with pytest.raises(ValueError, match="keep must be"):
        td.callbacks.BackupAndRestore("/tmp/x", keep=0)
    with pytest.raises(ValueError, match="needs a backup_dir"):
        td.callbacks.BackupAndRestore("")


def test_skipped_steps_report_the_restored_metrics_to_other_callbacks(tmp_path):
    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:  # epoch 0, after the backup at step 4
                raise RuntimeError("crash")

    class ReadLoss(keras.callbacks.Callback):
        seen = []

        def on_train_batch_end(self, batch, logs=None):
            ReadLoss.seen.append(float(logs["loss"]))

    backup = lambda: td.callbacks.BackupAndRestore(str(tmp_path), save_freq=4)  # noqa: E731
    with pytest.raises(RuntimeError, match="crash"):
        small_model().fit(small_data(), epochs=1, verbose=0, callbacks=[backup(), Stop()])
    callback = backup()
    small_model().fit(small_data(), epochs=1, verbose=0, callbacks=[callback, ReadLoss()])
    assert callback.restored_step == 4
    assert len(ReadLoss.seen) == 8 and all(np.isfinite(ReadLoss.seen))
    assert ReadLoss.seen[0] == ReadLoss.seen[3]  # the 4 skipped steps report the backup's loss


def slow_writes(callback, seconds):
    write = callback._store.write
    callback._store.write = lambda *a: (time.sleep(seconds), write(*a))[1]
    return callback


def test_a_save_due_while_one_is_written_waits_for_it(tmp_path, capsys):
    callback = slow_writes(td.callbacks.BackupAndRestore(str(tmp_path), save_freq=2,
                                                         delete_checkpoint=False), 0.5)
    start = time.monotonic()
    small_model().fit(small_data(), epochs=1, verbose=0, callbacks=[callback])
    # 4 saves of 0.5 s, one at a time: the last one done before fit returns.
    assert time.monotonic() - start >= 4 * 0.5
    assert "waited" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["backup-000000000006", "backup-000000000008"]


@pytest.mark.multiprocess
def test_an_exception_in_fit_still_finishes_the_backup_in_flight(tmp_path):
    code = textwrap.dedent(f"""
        import time, keras, numpy as np, tensorflow as tf
        import tf_distrib as td
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile("sgd", "mse")
        x = np.ones((64, 4), "float32")
        backup = td.callbacks.BackupAndRestore({str(tmp_path)!r}, save_freq=4)
        write = backup._store.write
        backup._store.write = lambda *a: (time.sleep(3), write(*a))[1]

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 4:
                    raise RuntimeError("crash")

        model.fit(x, x[:, :3], batch_size=8, verbose=0, callbacks=[backup, Crash()])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "RuntimeError: crash" in done.stderr
    assert "waiting for writing the backup of step 4" in done.stderr
    assert os.listdir(tmp_path) == ["backup-000000000004"]
    assert td.callbacks.backup_store.BackupStore(str(tmp_path), 2).read_latest() is not None


@pytest.mark.multiprocess
def test_sigterm_is_no_longer_trapped_once_fit_has_raised():
    code = textwrap.dedent("""
        import os, signal, time, keras, numpy as np
        import tf_distrib as td
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile("sgd", "mse")
        x = np.ones((64, 4), "float32")

        class Crash(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                raise RuntimeError("crash")

        try:
            model.fit(x, x[:, :3], batch_size=8, verbose=0, callbacks=[
                td.callbacks.BackupAndRestore("/tmp/unused-backup"), Crash()])
        except RuntimeError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends here
        time.sleep(5)
        print("still alive")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stdout + done.stderr
    assert "still alive" not in done.stdout


def test_backups_on_a_tf_io_gfile_filesystem(tmp_path):
    directory = f"ram://tf_distrib_test/{tmp_path.name}"
    fit_with_backups(directory)
    model = small_model()
    callback = td.callbacks.BackupAndRestore(directory, delete_checkpoint=False)
    model.fit(small_data(), epochs=3, verbose=0, callbacks=[callback])
    assert callback.restored_step == 16


def test_a_backup_holds_its_steps_state_while_training_goes_on(tmp_path):
    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:  # step 4, just saved
                self.at_save = [w.numpy() for w in self.model.weights]
            if batch == 6:  # steps 5-7 trained while the backup was written
                raise RuntimeError("stop")

    record = Record()
    callback = slow_writes(td.callbacks.BackupAndRestore(str(tmp_path), save_freq=4), 0.5)
    model = small_model()
    with pytest.raises(RuntimeError, match="stop"):
        model.fit(small_data(), epochs=1, verbose=0, callbacks=[callback, record])
    callback._writer.wait()
    manifest, arrays = td.callbacks.backup_store.BackupStore(str(tmp_path), 2).read_latest()
    assert manifest["step"] == 4
    for i, saved in enumerate(record.at_save):
        np.testing.assert_array_equal(arrays[f"model/{i}"], saved)
    assert not np.array_equal(model.weights[0].numpy(), record.at_save[0])


@pytest.mark.parametrize("delete_checkpoint, steps", [(True, [4, 8, 12]),
                                                      (False, [4, 8, 12, 16])])
def test_no_backup_after_the_last_step_when_fit_deletes_them(tmp_path, delete_checkpoint, steps):
    callback = td.callbacks.BackupAndRestore(str(tmp_path), save_freq=4,
                                             delete_checkpoint=delete_checkpoint)
    saved, write = [], callback._store.write
    callback._store.write = lambda step, *a: (saved.append(step), write(step, *a))[1]
    small_model().fit(small_data(), epochs=2, verbose=0, callbacks=[callback])
    assert saved == steps


def test_host_snapshot_copies_into_buffers_it_keeps():
    snapshot = td.callbacks.host_snapshot.HostSnapshot(threads=3)
    big = np.arange(5 << 20, dtype=np.float32)  # 20 MB: copied in pieces by 3 threads
    arrays = [("big", big), ("scalar", np.float64(2.5)), ("empty", np.zeros((0, 3), "int32")),
              ("strided", np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2])]
    first = snapshot.copy(arrays)
    for (name, source), (copied_name, copy) in zip(arrays, first, strict=True):
        assert name == copied_name
        np.testing.assert_array_equal(copy, source)
        assert copy.dtype == np.asarray(source).dtype
    big += 1
    second = snapshot.copy(arrays)
    assert second[0][1] is first[0][1]  # the same buffer, no new allocation
    assert all(copy.ctypes.data % mmap.PAGESIZE == 0 for _, copy in second)  # see DirectFile
    np.testing.assert_array_equal(second[0][1], big)
    reshaped = snapshot.copy([("big", big.reshape(1024, -1))])
    assert reshaped[0][1] is not first[0][1] and reshaped[0][1].shape == (1024, 5 << 10)
    snapshot.release()
    assert snapshot.copy(arrays)[0][1] is not first[0][1]


def test_host_snapshot_memory_is_faulted_in_before_the_first_copy():
    snapshot = td.callbacks.host_snapshot.HostSnapshot(threads=1)
    state = np.ones(64 << 20, np.uint8)  # 16384 pages
    snapshot.allocate([("state", state.shape, state.dtype)])
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    snapshot.copy([("state", state)])
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 1024


def _join_release_threads():
    for thread in threading.enumerate():
        if thread.name == td.callbacks.host_snapshot.RELEASE_THREAD_NAME:
            thread.join(10)


def test_a_released_snapshot_lends_its_memory_to_the_next_one():
    host_snapshot = td.callbacks.host_snapshot
    state = np.arange(64 << 20, dtype=np.uint8)  # 16384 pages
    first = host_snapshot.HostSnapshot(threads=1)
    address = first.copy([("state", state)])[0][1].ctypes.data
    first.release()
    _join_release_threads()

    second = host_snapshot.HostSnapshot(threads=1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second.allocate([("half", (32 << 20,), np.uint8)])  # fits in the lent block
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 1024
    half = state[32 << 20:]
    copy = second.copy([("half", half)])[0][1]
    assert copy.ctypes.data == address
    np.testing.assert_array_equal(copy, half)
    second.release()
    _join_release_threads()

    larger = host_snapshot.HostSnapshot(threads=1)
    larger = larger.copy([("state", state), ("more", half)])  # more than lent: maps anew
    np.testing.assert_array_equal(larger[0][1], state)
    np.testing.assert_array_equal(larger[1][1], half)


def test_host_memory_is_mapped_after_the_first_step_and_every_save_reuses_it(tmp_path):
    callback = td.callbacks.BackupAndRestore(str(tmp_path), save_freq=4)

    class Check(keras.callbacks.Callback):  # runs after `callback` at each hook
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                callback._writer.wait()  # the mapping, started by this step's end
                self.mapped = list(callback._snapshot._buffers)
                assert self.mapped
            if batch in (3, 7):  # steps 4 and 8 were just saved
                assert all(a is b for a, b in zip(callback._snapshot._buffers, self.mapped,
                                                  strict=True))

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    # Adam's slots and the metric's totals do not exist before the first step.
    model.compile(keras.optimizers.Adam(0.1), "mse", metrics=["mae"])
    model.fit(small_data(), epochs=2, verbose=0, callbacks=[callback, Check()])


def test_direct_file_writes_any_chunks_past_the_page_cache(tmp_path):
    aligned = np.frombuffer(mmap.mmap(-1, 3 << 20), np.uint8)  # page-aligned memory
    aligned[:] = np.arange(aligned.size) % 251
    chunks = [b"", b"ten bytes!", aligned[:4096 + 7],        # unaligned file offset: staged
              bytes(-(4096 + 17) % 4096),                    # pads the file to a block
              aligned, np.arange(9 << 18, dtype=np.int32),   # written as is; then staged
              b"tail"]
    path = tmp_path / "state.bin"
    with td.callbacks.direct_file.DirectFile(str(path)) as f:
        for chunk in chunks:
            f.write(chunk)
    expected = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    assert path.read_bytes() == expected  # exact size: the padded last block cut off
    if sys.platform.startswith("linux"):  # ext4, xfs, btrfs take O_DIRECT (tmpfs does not)
        assert f.direct


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_large_arrays_start_on_a_block_in_the_state_file(tmp_path, monkeypatch, direct):
    backup_store = td.callbacks.backup_store
    monkeypatch.setattr(backup_store, "_DIRECT_FROM_BYTES", 0 if direct else 1 << 62)
    store = backup_store.BackupStore(str(tmp_path), 1)
    arrays = [("bias", np.arange(3, dtype=np.float32)),
              ("kernel", np.arange(1 << 18, dtype=np.float32).reshape(512, 512)),
              ("step", np.int64(7))]
    store.write(1, arrays, {})
    manifest, restored = store.read_latest()
    assert [e["offset"] for e in manifest["arrays"]] == [0, 4096, 4096 + (1 << 20)]
    for name, value in arrays:
        np.testing.assert_array_equal(restored[name], value)


def _train_with_a_directory_per_worker(root):
    import keras
    import numpy as np

    import tf_distrib as td

    strategy = td.make_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x = np.ones((64, 4), "float32")
    own = os.path.join(root, os.environ["TF_DISTRIB_WORKER_INDEX"])  # as on each host's disk
    try:
        model.fit(x, x[:, :1], batch_size=16, verbose=0,
                  callbacks=[td.callbacks.BackupAndRestore(own)])
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.multiprocess
def test_a_backup_directory_that_is_not_shared_is_refused_naming_the_workers(tmp_path):
    workers = run_workers(_train_with_a_directory_per_worker, 2, args=(str(tmp_path),),
                          quiet=True, timeout=180)
    for worker in workers:
        assert "worker:1 cannot see the files the chief writes" in worker.value
        assert f"backup_dir {tmp_path}/" in worker.value and "shared file system" in worker.value
    assert not any(p.name.startswith(".tf_distrib-probe") for p in (tmp_path / "0").iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts a small tmpfs as /dev/shm")
def test_a_full_dev_shm_turns_snapshots_off_with_a_warning_and_training_goes_on(tmp_path,
                                                                              monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(shm)], check=True)
    try:
        monkeypatch.setenv(td.contract.ENV_SNAPSHOT_DIR, str(shm))
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4096)])  # 80 KB
        model.compile(keras.optimizers.SGD(0.1), "mse")
        x = np.zeros((64, 4), "float32")
        callback = td.callbacks.BackupAndRestore(str(tmp_path / "b"), snapshot_freq=1)
        with pytest.warns(RuntimeWarning, match="in-memory snapshots are off for this fit: "
                                                ".*No space left on device"):
            model.fit(x, np.zeros((64, 4096), "float32"), batch_size=8, epochs=2, verbose=0,
                      callbacks=[callback])
        assert int(model.optimizer.iterations.numpy()) == 16
        assert [p.name for p in shm.rglob("part-*")] == []
    finally:
        subprocess.run(["umount", "--lazy", str(shm)], check=False)
