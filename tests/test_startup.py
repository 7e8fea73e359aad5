"""Workers stopped or slow before their first step: named with their phase, restarted."""

import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests._faults import STEPS_PER_EPOCH, train
from tf_distrib.cluster import free_ports
from tf_distrib.health import phases
from tf_distrib.launch import launch
from tf_distrib.launch.liveness import is_stopped

pytestmark = pytest.mark.multiprocess

HANG_TIMEOUT = 20
EPOCHS = 2


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    result = launch(train, 2, kwargs={"backup_dir": str(tmp_path_factory.mktemp("backup")),
                                      "epochs": EPOCHS},
                    hang_timeout=HANG_TIMEOUT, quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    return result.values[0]["weights"]


def _launch(backup_dir, **kwargs):
    return launch(train, 2, kwargs={"backup_dir": str(backup_dir), "epochs": EPOCHS, **kwargs},
                  max_restarts=1, hang_timeout=HANG_TIMEOUT, quiet=True, timeout=400)


def _assert_bitwise(result, uninterrupted):
    assert result.exit_code == 0, result.failure_report()
    for worker in result.values:
        for got, want in zip(worker["weights"], uninterrupted, strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("phase", [phases.STARTING, phases.CLUSTER, phases.TRANSPORT,
                                   phases.FIRST_STEP])
def test_a_worker_stopped_in_each_startup_phase_is_named_and_the_job_restarts(
        tmp_path, uninterrupted, phase):
    result = _launch(tmp_path, stop_in=phase)
    _assert_bitwise(result, uninterrupted)
    stopped = result.attempts[0]
    assert stopped.failure.startswith("worker 1 was stopped (process state T, as after SIGSTOP)"
                                      f" for 5 s during {phases.describe(phase)}"), stopped.failure
    assert stopped.stopped_first == [1] and result.restarts == 1
    print(f"stopped in {phase}: attempt 0 ended after {stopped.seconds:.1f} s")
    assert stopped.seconds < HANG_TIMEOUT + 30
    assert result.exit_codes[0][1] == -signal.SIGKILL


def test_a_worker_stopped_while_restoring_a_backup_is_named_and_the_job_resumes(
        tmp_path, uninterrupted):
    first = launch(train, 2, kwargs={"backup_dir": str(tmp_path), "epochs": 1},
                   hang_timeout=HANG_TIMEOUT, quiet=True, timeout=300)
    assert first.exit_code == 0, first.failure_report()
    result = _launch(tmp_path, stop_in=phases.RESTORING)
    _assert_bitwise(result, uninterrupted)
    stopped = result.attempts[0]
    assert f"during {phases.describe(phases.RESTORING)}" in stopped.failure, stopped.failure
    assert stopped.seconds < HANG_TIMEOUT + 30
    assert [w.value["restored_step"] for w in result.workers] == [STEPS_PER_EPOCH] * 2


HOST_JOB = f"""
import hashlib, sys
from tests._faults import train

weights = train(backup_dir=sys.argv[1], epochs={EPOCHS}, stop_in=sys.argv[2])["weights"]
print("weights", hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest())
"""


def test_under_hosts_a_stopped_remote_worker_is_named_by_its_host_and_its_peer(
        tmp_path, uninterrupted):
    script = tmp_path / "job.py"
    script.write_text(HOST_JOB)
    hosts = ",".join(f"127.0.0.1:{port}" for port in free_ports(2))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "tf_distrib.launch", "-n", "1", "--hosts", hosts,
         "--host-index", str(i), "--max-restarts", "2", "--hang-timeout", str(HANG_TIMEOUT),
         "--timeout", "300", str(script), str(tmp_path / "backup"), phases.TRANSPORT],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=330)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs
    # Host 1's launcher sees its worker stopped; host 0's worker names it within the bound.
    assert ("attempt 0 failed: worker 1 was stopped (process state T, as after SIGSTOP) for "
            f"5 s during {phases.describe(phases.TRANSPORT)}") in outputs[1]
    assert (f"worker:1 did not join the transport's rendezvous within {HANG_TIMEOUT} s"
            in outputs[0])
    want = hashlib.sha256(b"".join(w.tobytes() for w in uninterrupted)).hexdigest()
    assert [line.split()[-1] for out in outputs for line in out.splitlines()
            if "] weights " in line] == [want, want]


def test_a_slow_but_alive_start_is_waited_for_within_the_startup_timeout(tmp_path,
                                                                         uninterrupted):
    # Slower than the hang timeout, within the startup timeout.
    result = launch(train, 2, kwargs={"backup_dir": str(tmp_path), "epochs": EPOCHS,
                                      "slow_start": 15},
                    hang_timeout=10, startup_timeout=90, quiet=True, timeout=400)
    _assert_bitwise(result, uninterrupted)
    assert result.restarts == 0


def test_a_start_slower_than_the_startup_timeout_is_named(tmp_path):
    start = time.monotonic()
    result = launch(train, 2, kwargs={"backup_dir": str(tmp_path), "slow_start": 30},
                    hang_timeout=HANG_TIMEOUT, startup_timeout=20, grace_period=1,
                    quiet=True, timeout=400)
    assert result.exit_code != 0
    failure = result.attempts[0].failure
    assert failure.startswith("worker 1 did not reach its first training step within "
                              "startup_timeout=20 s (TensorFlow's server on 127.0.0.1:"), failure
    assert f"still in {phases.describe(phases.STARTING)}" in failure
    assert f"waiting: worker 0 in {phases.describe(phases.CLUSTER)}" in failure
    assert "larger --startup-timeout" in failure
    assert time.monotonic() - start < 20 + 15


def test_is_stopped_reads_the_process_state():
    import subprocess

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_stopped(sleeper.pid)
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(sleeper.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(sleeper.pid)
        sleeper.send_signal(signal.SIGCONT)
        time.sleep(0.1)
        assert not is_stopped(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not is_stopped(sleeper.pid)  # gone
