"""Hung, stopped and slow workers in real processes: named, stopped, restarted."""

import signal

import pytest

from tests._faults import train
from tf_distrib import contract
from tf_distrib.launch import launch
from tf_distrib.launch import reports as reports_lib

pytestmark = pytest.mark.multiprocess

HANG_TIMEOUT = 6


@pytest.mark.parametrize("stall_in", ["callback", "input"])
def test_a_worker_that_stops_stepping_is_named_and_the_job_resumes(tmp_path, stall_in):
    result = launch(train, 2, kwargs={"backup_dir": str(tmp_path), "stall_at": 15,
                                      "stall_in": stall_in, "epochs": 1},
                    max_restarts=1, hang_timeout=HANG_TIMEOUT, quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    hung = result.attempts[0]
    assert result.exit_codes[0] == [contract.HUNG_EXIT_CODE] * 2
    assert hung.stopped_first == [1]
    assert "stopped first: worker 1 (its last finished step: 15" in hung.failure, hung.failure
    # Both stopped within the hang timeout (+30 s) of the stall, start-up included.
    assert hung.seconds < 20 + HANG_TIMEOUT + 30
    report = "".join(hung.workers[0].output)
    assert f"tf_distrib watchdog: worker:0: no step finished for {HANG_TIMEOUT} s" in report \
        or "reported a hang" in report
    assert_resumed_before_the_stop(result)


def test_a_sigstopped_worker_is_named_by_the_launcher_and_the_job_resumes(tmp_path):
    result = launch(train, 2, kwargs={"backup_dir": str(tmp_path), "stop_at": 15, "epochs": 1},
                    max_restarts=1, hang_timeout=HANG_TIMEOUT, quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    stopped = result.attempts[0]
    # Seen stopped (state T) before any watchdog fires: named without reports.
    assert stopped.failure.startswith("worker 1 was stopped (process state T, as after "
                                      "SIGSTOP) for 5 s during training"), stopped.failure
    assert result.exit_codes[0][1] == -signal.SIGKILL
    assert stopped.stopped_first == [1]
    assert_resumed_before_the_stop(result)


def assert_resumed_before_the_stop(result):
    """From the newest of the backup of step 10 and the in-memory snapshots (as often as
    their cost allows), at most step 15, where worker 1 stopped; the same on both."""
    restored = [w.value["restored_step"] for w in result.workers]
    assert restored[0] == restored[1] and 10 <= restored[0] <= 15, restored


@pytest.mark.parametrize("plain", [False, True], ids=["distribute_dataset", "plain_dataset"])
def test_a_slow_worker_is_named_a_straggler_and_balanced_runs_are_not(tmp_path, plain):
    # With a plain dataset of full batches, built alike on both workers, TensorFlow's
    # per-step count of the workers that have data is skipped (`_equal_batches`): the
    # slow worker is seen in the gradients' all-reduce, as through distribute_dataset.
    slow = launch(train, 2, kwargs={"slow_worker": 1, "slow_seconds": 0.05, "epochs": 2,
                                    "plain": plain}, quiet=True, timeout=300)
    assert slow.exit_code == 0, slow.failure_report()
    chief = "".join(slow.workers[0].output)
    assert "straggler(s) worker:1 (127.0.0.1:" in chief
    busy = slow.values[0]["history"]
    assert busy["busy_time/worker_1"][0] > busy["busy_time/worker_0"][0] + 0.04
    balanced = launch(train, 2, kwargs={"epochs": 6, "plain": plain}, quiet=True, timeout=300)
    assert balanced.exit_code == 0, balanced.failure_report()
    assert "straggler" not in "".join(w for worker in balanced.workers for w in worker.output)


def test_a_slow_save_does_not_trip_the_watchdog(tmp_path):
    result = launch(train, 2, kwargs={"backup_dir": str(tmp_path), "slow_save": 4,
                                      "epochs": 1}, hang_timeout=6, quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    assert result.restarts == 0


@pytest.mark.slow
def test_three_runs_in_a_row_exit_cleanly():
    # Exits that hang now and then; `make chaos` runs hundreds of launches more.
    def job():
        import keras
        import numpy as np
        import tensorflow as tf

        import tf_distrib as td

        strategy = td.make_strategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        x = np.ones((64, 4), "float32")
        model.fit(td.data.distribute_dataset(
            strategy, tf.data.Dataset.from_tensor_slices((x, x[:, :1])), 16), verbose=0)

    for _ in range(3):
        result = launch(job, 2, quiet=True, timeout=120)
        assert result.exit_codes == [[0, 0]], result.failure_report()


def test_reports_name_the_worker_the_others_wait_for():
    waiting = {"steps": 7, "in_step": True, "cause": "no step finished for 9 s",
               "transport": {"waiting_for": ["worker:2 (127.0.0.1:5)"]}}
    silent = {"steps": 7, "in_step": True, "cause": "no step finished for 9 s",
              "transport": {"waiting_for": []}}
    assert reports_lib.stopped_first({0: waiting, 1: dict(waiting), 2: silent}) == [2]
    # Without transport evidence: the one outside a step while others wait inside.
    callback = {**silent, "transport": None, "in_step": False}
    blocked = {**silent, "transport": None}
    assert reports_lib.stopped_first({0: blocked, 1: callback}) == [1]
    assert reports_lib.stopped_first({0: {**blocked, "steps": 9}, 1: blocked}) == [1]
    lost = {"cause": "worker:0 (127.0.0.1:1) closed the connection", "lost_peer": "worker:0"}
    assert reports_lib.stopped_first({1: lost}) == [0]
