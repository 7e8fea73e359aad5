"""In-memory snapshots: the slot files, torn and killed writes, the launcher's directory."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest

from tf_distrib import contract
from tf_distrib.callbacks import memory_snapshot
from tf_distrib.callbacks.memory_snapshot import MemorySnapshot
from tf_distrib.launch import launch, snapshots


def state(step: int) -> list:
    """A state of several dtypes and shapes (a scalar too), its values set by `step`."""
    return [("model/0", np.full((33, 7), step, np.float32)),
            ("model/1/bf16", np.full(3, step, ml_dtypes.bfloat16)),
            ("model/1", np.arange(5, dtype=np.float64) + step),
            ("optimizer/0", np.int64(step)),
            ("rng/0", np.array([step, -step], np.int32))]


def write(snapshot, step, metadata, arrays):
    snapshot.write(step, metadata, [(name, np.asarray(value).dtype, np.shape(value))
                                    for name, value in arrays],
                   lambda i: arrays[i][1])


def assert_state(arrays: dict, step: int) -> None:
    want = dict(state(step))
    assert list(arrays) == list(want)
    for name, value in want.items():
        assert arrays[name].dtype == value.dtype and arrays[name].shape == np.shape(value)
        np.testing.assert_array_equal(arrays[name], value)


@pytest.mark.parametrize("parts", [1, 3])
def test_a_hosts_parts_make_the_whole_state_and_two_slots_keep_the_previous(tmp_path, parts):
    writers = [MemorySnapshot(str(tmp_path), part, parts) for part in range(parts)]
    for step in (1, 2, 3):
        assert writers[0].steps() == list(range(step - 1, 0, -1))  # before this step's parts
        for writer in writers:
            write(writer, step, {"epoch": step}, state(step))
    assert writers[0].steps() == [3, 2]
    manifest, arrays = writers[-1].read(3)
    assert manifest == {"step": 3, "metadata": {"epoch": 3}}
    assert_state(arrays, 3)
    assert_state(writers[0].read(2)[1], 2)
    assert len(os.listdir(tmp_path)) == 2 * parts
    for writer in writers:
        writer.close(delete=True)
    assert os.listdir(tmp_path) == []


def test_each_part_reads_only_the_arrays_in_its_byte_range(tmp_path):
    specs = [(name, np.asarray(value).dtype, np.shape(value)) for name, value in state(1)]
    # 924 + 6 + 40 + 8 + 8 bytes: the first array spans all 3 parts, the rest is in 2.
    assert [MemorySnapshot(str(tmp_path), part, 3).indices(specs) for part in range(3)] == [
        [0], [0], [0, 1, 2, 3, 4]]
    assert MemorySnapshot(str(tmp_path), 0, 1).indices(specs) == [0, 1, 2, 3, 4]


def test_an_uncommitted_slot_is_skipped_and_the_previous_step_restores(tmp_path):
    writers = [MemorySnapshot(str(tmp_path), part, 2) for part in range(2)]
    for step in (1, 2):
        for writer in writers:
            write(writer, step, {}, state(step))
    # Part 1's slot of step 2 torn as a writer that died mid-copy leaves it: its begin
    # counter ahead of its end counter.
    path = next(p for p in (tmp_path / "part-1-of-2.0", tmp_path / "part-1-of-2.1")
                if b'"step": 2' in p.read_bytes())
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(8, "little"))
    assert writers[0].steps() == [1]
    with pytest.raises(KeyError, match="no complete snapshot of step 2"):
        writers[0].read(2)
    assert_state(writers[0].read(1)[1], 1)


def test_parts_of_an_attempt_with_other_workers_on_the_host_are_their_own_set(tmp_path):
    write(MemorySnapshot(str(tmp_path), 0, 1), 7, {}, state(7))
    write(MemorySnapshot(str(tmp_path), 1, 2), 9, {}, state(9))  # part 0 of 2 never wrote
    assert MemorySnapshot(str(tmp_path), 0, 2).steps() == [7]


KILLED_WRITER = """
import importlib.util, sys, numpy as np
# The module alone (numpy only): the package's import of TensorFlow would take seconds.
spec = importlib.util.spec_from_file_location("memory_snapshot", sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
snapshot = module.MemorySnapshot(sys.argv[1], 0, 1)
big = np.empty(4 << 20, np.float32)
step = 0
while True:
    step += 1
    big.fill(step)
    arrays = [big, np.int64(step)]
    snapshot.write(step, {}, [("big", big.dtype, big.shape), ("step", np.int64, ())],
                   arrays.__getitem__)
    if step == 1:
        print("written", flush=True)
"""


def test_a_writer_killed_at_any_moment_leaves_a_whole_snapshot(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(KILLED_WRITER))
    for trial in range(5):
        directory = tmp_path / f"shm-{trial}"
        directory.mkdir()
        writer = subprocess.Popen([sys.executable, str(script), str(directory),
                                   memory_snapshot.__file__],
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline() == "written\n"
        time.sleep(0.01 * trial)  # 16 MB copies: each moment lands in another one
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        reader = MemorySnapshot(str(directory), 0, 1)
        newest = reader.steps()[0]
        _, arrays = reader.read(newest)
        assert int(arrays["step"]) == newest
        assert (arrays["big"] == newest).all()


def test_the_launch_directory_is_made_and_freed_and_stale_ones_are_deleted(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{snapshots.PREFIX}{dead.pid}-x"
    stale.mkdir()
    alive = tmp_path / f"{snapshots.PREFIX}{os.getpid()}-y"
    alive.mkdir()
    with snapshots.owned(root=str(tmp_path)) as directory:
        assert os.path.isdir(directory) and not stale.exists() and alive.exists()
        (tmp_path / directory / "part-0-of-1.0").write_bytes(b"x")
    assert not os.path.exists(directory)
    with snapshots.owned(enabled=False, root=str(tmp_path)) as directory:
        assert directory is None


def report_snapshot_dir_then_fail(out):
    with open(os.path.join(out, f"dir-{contract.worker_index()}"), "w") as f:
        f.write(f"{contract.snapshot_dir()} {contract.local_workers()}")
    raise SystemExit(3)


@pytest.mark.multiprocess
def test_a_failed_launch_frees_its_snapshots(tmp_path):
    result = launch(report_snapshot_dir_then_fail, 2, args=(str(tmp_path),), quiet=True,
                    timeout=120)
    assert result.exit_code == 3
    reported = [(tmp_path / f"dir-{i}").read_text().split(" ", 1) for i in range(2)]
    assert reported[0][0] == reported[1][0]
    assert reported[0][0].startswith(f"/dev/shm/{snapshots.PREFIX}{os.getpid()}-")
    assert [r[1] for r in reported] == ["(0, 2)", "(1, 2)"]
    assert not os.path.exists(reported[0][0])


def test_local_workers_are_checked():
    assert contract.local_workers({}) == (0, 1)
    with pytest.raises(ValueError, match="TF_DISTRIB_LOCAL_INDEX=2 is not below"):
        contract.local_workers({contract.ENV_LOCAL_INDEX: "2", contract.ENV_LOCAL_WORKERS: "2"})
