"""Keras' gradient_accumulation_steps under make_strategy()'s strategies, in real processes."""

import keras
import numpy as np
import pytest

import tf_distrib as td
from tests._accumulation import STEPS_PER_EPOCH, train
from tf_distrib.launch import launch
from tf_distrib.testing import run_workers

pytestmark = pytest.mark.multiprocess

K = 4


@pytest.fixture(scope="module")
def references():
    """One process, no strategy, no accumulation, the K-times larger batch of 256."""
    return {opt: run_workers(train, 1, args=(256, None, opt), startup_timeout=None,
                             quiet=True)[0].value for opt in ("sgd", "adam")}


def assert_close_to(result, reference, atol=1e-6):
    for w, r in zip(result["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(w, r, rtol=0, atol=atol)


@pytest.mark.parametrize("transport", ["auto", "tf"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_workers_accumulating_equal_one_big_batch(references, optimizer, transport):
    a, b = (w.value for w in run_workers(train, 2, args=(64, K, optimizer),
                                           kwargs={"transport": transport}, quiet=True))
    assert a["transport"] == ("shm" if transport == "auto" else None)
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        np.testing.assert_array_equal(wa, wb)
    assert a["updates"] == 2 * STEPS_PER_EPOCH  # Keras counts updates, not micro-steps
    assert_close_to(a, references[optimizer])
    if transport == "auto":
        # Every micro-step reduces its logged loss; only every K-th one the gradients.
        micro_steps = 2 * STEPS_PER_EPOCH * K
        assert a["collectives"] == micro_steps + micro_steps // K


def test_mirrored_strategy_accumulates_locally_and_reduces_once_per_update(references):
    [worker] = run_workers(train, 1, args=(64, K, "sgd"),
                           kwargs={"logical_cpus": 2, "counting": True},
                           startup_timeout=None, quiet=True)
    result = worker.value
    assert result["updates"] == 2 * STEPS_PER_EPOCH
    assert result["counted"] == 2 * STEPS_PER_EPOCH  # one gradient reduction per update
    assert_close_to(result, references["sgd"])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_replica_accumulates_bitwise_as_keras_does(optimizer):
    # tf_distrib's accumulation makes two passes over the gradients fewer per update
    # (optimizer_hooks); SGD divides its learning rate by K, not the sums.
    ours, keras_own = (run_workers(train, 1, args=(64, K, optimizer), kwargs={
        "logical_cpus": 1, "momentum": 0.9, "keras_own": own}, quiet=True)[0].value
        for own in (False, True))
    assert ours["updates"] == keras_own["updates"] == 2 * STEPS_PER_EPOCH
    for w, r in zip(ours["weights"], keras_own["weights"], strict=True):
        np.testing.assert_array_equal(w, r)


def test_bf16_compression_stays_within_its_bound(references):
    a, b = (w.value for w in run_workers(train, 2, args=(64, K, "sgd"),
                                           kwargs={"compression": "bf16"}, quiet=True))
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        np.testing.assert_array_equal(wa, wb)
    # bf16 rounds each update's gradients once (relative 2^-8): over 64 SGD updates at
    # lr 0.1 with gradients below 1, weights move at most 64 * 0.1 * 2^-8 = 0.025 apart.
    assert_close_to(a, references["sgd"], atol=64 * 0.1 * 2.0 ** -8)
    assert any(not np.array_equal(w, r)
               for w, r in zip(a["weights"], references["sgd"]["weights"], strict=True))


def test_killed_between_micro_steps_resumes_bitwise(tmp_path):
    reference = run_workers(train, 2, args=(64, K, "adam"), kwargs={
        "backup_dir": str(tmp_path / "reference")}, quiet=True)[0].value
    # SIGKILL after step 34 = micro-step 2 of 4; the save due at step 30 waited for the
    # update at step 32, and the restart resumes there.
    result = launch(train, 2, args=(64, K, "adam"), kwargs={
        "backup_dir": str(tmp_path / "killed"), "kill_at": 34}, max_restarts=1, quiet=True,
        timeout=300)
    assert result.exit_code == 0, result.failure_report()
    assert result.exit_codes[0][1] == -9
    for worker in result.workers:
        assert worker.value["restored_step"] == 32
        for w, r in zip(worker.value["weights"], reference["weights"], strict=True):
            np.testing.assert_array_equal(w, r)


@pytest.mark.parametrize("steps", [0, 2.5, False])
def test_bad_accumulation_steps_are_refused_under_a_strategy(steps):
    # Keras itself refuses 1 and True, and silently trains without accumulation on 0.
    strategy = td.make_strategy()  # 4 logical CPUs in the test process
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(gradient_accumulation_steps=steps), "mse")
    x = np.ones((16, 2), "float32")
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an integer >= 2"):
        model.fit(x, x[:, :1], batch_size=8, verbose=0)


@pytest.mark.parametrize("steps", [1, True])
def test_keras_refuses_one_and_true(steps):
    with pytest.raises(ValueError, match="must be an integer >= 2"):
        keras.optimizers.SGD(gradient_accumulation_steps=steps)
