"""Backups survive a power loss: the order of a save's system calls, and storage faults."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import keras
import pytest

import tf_distrib as td
from tf_distrib.callbacks.backup_store import BackupStore
from tf_distrib.chaos.faults import fill

_SAVE_TWO_BACKUPS = textwrap.dedent("""
    import sys
    import numpy as np
    from tf_distrib.callbacks import backup_store
    for directory, threshold in (sys.argv[1], None), (sys.argv[2], 1):
        if threshold:  # the path of large states, past the page cache (O_DIRECT)
            backup_store._DIRECT_FROM_BYTES = threshold
        store = backup_store.BackupStore(directory, keep=1)
        for step in (1, 2):
            store.write(step, [("w", np.full(3000, step, np.float32))], {})
""")
_CALL = re.compile(r"^\d+\s+(\w+)\((.*)\)\s+=\s+(-?\d+)")
_FD_PATH = re.compile(r"^\d+<([^>]*)>")


@pytest.fixture(scope="module")
def traced_saves(tmp_path_factory):
    """Two saves each into "buffered/" and "direct/", traced: (trace lines, root)."""
    if shutil.which("strace") is None:
        pytest.skip("needs strace (apt-get install strace; `make system-deps`)")
    root = tmp_path_factory.mktemp("durable")
    trace = root / "trace"
    # --seccomp-bpf: only the traced calls stop the process, not the rest of TensorFlow's
    # start (38 s -> 8 s).
    subprocess.run(
        ["strace", "-f", "--seccomp-bpf", "-qq", "-y", "-o", str(trace), "-e",
         "trace=openat,write,pwrite64,fsync,fdatasync,rename,renameat,renameat2,"
         "unlink,unlinkat,rmdir", sys.executable, "-c", _SAVE_TWO_BACKUPS,
         str(root / "buffered"), str(root / "direct")],
        check=True, capture_output=True, timeout=120)
    return trace.read_text().splitlines(), root


def _calls(lines, backup_dir):
    """The save's file-system calls in the order they returned: (call, path, other path)."""
    calls, mine = [], re.compile(re.escape(str(backup_dir)) + r'[/>"]')
    for line in lines:
        match = _CALL.match(line)
        if not match or int(match[3]) < 0 or not mine.search(line):
            continue
        name, args = match[1], match[2]
        paths = re.findall(r'"([^"]*)"', args)
        fd = _FD_PATH.match(args)
        if fd:
            paths.insert(0, fd[1])
        calls.append((name, *paths[:2]))
    return calls


def _index(calls, name, test):
    found = [i for i, call in enumerate(calls) if call[0] == name and test(*call[1:])]
    assert found, f"no {name} matching in {calls}"
    return found


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_a_save_makes_data_durable_before_its_manifest_and_deletes_old_backups_last(
        traced_saves, mode):
    lines, root = traced_saves
    backup_dir = root / mode
    calls = _calls(lines, backup_dir)
    new = f"{backup_dir}/backup-000000000002"
    old = f"{backup_dir}/backup-000000000001"
    state, manifest = f"{new}/state.bin", f"{new}/manifest.json"

    last_state_write = _index(calls, "write", lambda p, *_: p == state)[-1]
    state_synced = _index(calls, "fsync", lambda p, *_: p == state)[0]
    manifest_synced = _index(calls, "fsync", lambda p, *_: p.startswith(manifest + ".tmp-"))[0]
    commit = _index(calls, "rename", lambda a, b=None: b == manifest)[0]
    new_dir_synced = _index(calls, "fsync", lambda p, *_: p == new)[0]
    root_synced = [i for i in _index(calls, "fsync", lambda p, *_: p == str(backup_dir))
                   if i > commit]
    retired = _index(calls, "rename", lambda a, b=None: a == old)[0]
    deleted = [i for i, (name, *paths) in enumerate(calls)
               if name in ("unlink", "unlinkat", "rmdir") and "/.retired-" in paths[0]]

    # Data durable, then the commit record, then the directory entries...
    assert last_state_write < state_synced < commit
    assert manifest_synced < commit < new_dir_synced
    assert root_synced and root_synced[0] < retired
    # ... and the old backup leaves the listing only then, durably, before its files go.
    assert deleted and any(retired < i < deleted[0] for i in root_synced)
    assert not os.path.exists(old) and os.path.exists(manifest)


# Storage faults, in the pytest process (4 logical CPUs, no strategy): a small tmpfs as
# the backup directory's file system.

def _root_or_skip():
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs as the backup file system")


@pytest.fixture
def disk(tmp_path):
    """A 1 MiB tmpfs; the backups go to `backups/` on it."""
    _root_or_skip()
    path = tmp_path / "disk"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=True)
    (path / "backups").mkdir()
    yield path
    subprocess.run(["chattr", "-i", str(path / "backups")], capture_output=True)
    subprocess.run(["umount", "--lazy", str(path)], check=True)


def _remount(disk, mode):
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)], check=True)


def _wait_for_the_backup_thread():
    from tf_distrib.callbacks.background_save import THREAD_NAME

    deadline = time.monotonic() + 30
    while any(t.name == THREAD_NAME for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _stall(backup_dir):
    """The next backup's state file becomes a FIFO: opening it blocks, like a hung mount."""
    directory = backup_dir / "backup-000000000008"
    directory.mkdir(parents=True)
    os.mkfifo(directory / "state.bin")


def _unstall(backup_dir, readers):
    readers.append(os.open(backup_dir / "backup-000000000008" / "state.bin",
                           os.O_RDONLY | os.O_NONBLOCK))
    # The released save ends in moments, but the next steps take less: until it has
    # ended, the save at step 16 would still find it stalled (a third failure).
    _wait_for_the_backup_thread()


# fault: (inject(disk, backup_dir, readers), undo(...), what the warning says)
FAULTS = {
    "full disk": (lambda d, b, r: fill(str(d / "filler")), lambda d, b, r: os.remove(d / "filler"),
                  "No space left on device"),
    "read-only": (lambda d, b, r: _remount(d, "ro"), lambda d, b, r: _remount(d, "rw"),
                  "Read-only file system"),
    "permission denied": (
        lambda d, b, r: subprocess.run(["chattr", "+i", str(b)], check=True),
        lambda d, b, r: subprocess.run(["chattr", "-i", str(b)], check=True),
        "Operation not permitted"),
    "stalled": (lambda d, b, r: _stall(b), lambda d, b, r: _unstall(b, r),
                "stalled: still running after 1 s"),
}


class _Fault(keras.callbacks.Callback):
    """Injects a storage fault after step 6 and undoes it after step `undo_at`."""

    def __init__(self, inject, undo, undo_at=10):
        super().__init__()
        self.inject, self.undo, self.undo_at = inject, undo, undo_at
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == 6:
            self.inject()
        elif self.step == self.undo_at:
            self.undo()


def _fit(backup_dir, fault, **kwargs):
    from tests.test_backup_and_restore import small_data, small_model

    backup = td.callbacks.BackupAndRestore(str(backup_dir), save_freq=4,
                                           delete_checkpoint=False, save_timeout=1, **kwargs)
    # 2 epochs of 8 steps: backups at steps 4, 8, 12 and 16; the one at step 8 meets the fault.
    small_model().fit(small_data(), epochs=2, verbose=0, callbacks=[fault, backup])
    return backup


def _newest_usable(backup_dir):
    restored = BackupStore(str(backup_dir), 2).read_latest()
    return restored and restored[0]["step"]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_save_is_named_keeps_the_previous_backup_and_training_goes_on(
        disk, fault, async_save):
    backup_dir, readers = disk / "backups", []
    inject, undo, cause = FAULTS[fault]
    seen = []

    def check_and_undo():
        seen.append(_newest_usable(backup_dir))  # while the fault lasts: step 4's backup
        undo(disk, backup_dir, readers)

    # A stall is seen at the next save (step 12 when asynchronous), which cannot start
    # while the stalled one still runs: it lasts until step 13.
    undo_at = 13 if fault == "stalled" else 10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(backup_dir, _Fault(lambda: inject(disk, backup_dir, readers), check_and_undo,
                                undo_at), async_save=async_save)
    for fd in readers:
        os.close(fd)
    failed = [str(w.message) for w in caught if "failed:" in str(w.message)]
    assert f"the backup of step 8 to {backup_dir} failed" in failed[0]
    assert cause in failed[0] and "the backup of step 4 stays the newest" in failed[0]
    assert seen == [4]
    assert _newest_usable(backup_dir) == 16
    if fault == "stalled":
        assert len(failed) == 2 and "the backup of step 12" in failed[1]
        assert "is still stalled" in failed[1]
        assert sorted(os.listdir(backup_dir)) == ["backup-000000000004", "backup-000000000016"]
    else:
        assert len(failed) == 1, failed
        assert sorted(os.listdir(backup_dir)) == ["backup-000000000012", "backup-000000000016"]


def _remove_when_written(backup_dir):
    """Deletes the directory once the backup thread is done with it (not under its feet)."""
    _wait_for_the_backup_thread()
    shutil.rmtree(backup_dir)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_backup_directory_removed_while_training_is_made_again(tmp_path, async_save):
    backup_dir = tmp_path / "backups"
    with pytest.warns(RuntimeWarning, match=f"{backup_dir} has disappeared"):
        _fit(backup_dir, _Fault(lambda: _remove_when_written(backup_dir), lambda: None),
             async_save=async_save)
    assert _newest_usable(backup_dir) == 16


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_saves_failing_in_a_row_stop_training_with_a_named_error(disk, async_save):
    backup_dir = disk / "backups"
    fault = _Fault(lambda: _remount(disk, "ro"), lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(td.callbacks.BackupError) as raised:
            _fit(backup_dir, fault, async_save=async_save, max_failed_saves=2)
    message = str(raised.value)
    assert f"to {backup_dir} failed" in message and "Read-only file system" in message
    assert "step 4 stays the newest" in message and "2 saves failed in a row" in message
    assert fault.step == (16 if async_save else 12)  # async: seen at the next wait
    _remount(disk, "rw")
    assert _newest_usable(backup_dir) == 4
