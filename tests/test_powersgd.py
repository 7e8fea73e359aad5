"""PowerSGD: low-rank sums that lose nothing (error feedback), on every worker the same,
and a killed job that resumes bitwise with the residuals of every worker."""

import os

import numpy as np
import pytest

from tests._training import train_with_backup
from tf_distrib.cross_device import PowerSGD
from tf_distrib.launch import launch
from tf_distrib.testing import run_workers


def test_which_gradients_travel_as_factors():
    config = PowerSGD(rank=4, min_size=4096)
    assert config.compresses((784, 1024)) and config.compresses((3, 3, 64, 64))
    assert not config.compresses((1024,))  # a vector
    assert not config.compresses((32, 32))  # under min_size
    assert not config.compresses((4096, 4))  # rank 4 of 4 columns saves nothing
    with pytest.raises(ValueError, match="PowerSGD rank must be an integer >= 1"):
        PowerSGD(rank=0)


def test_powersgd_without_tf_distribs_transport_is_refused_with_the_fix():
    import tf_distrib as td

    with pytest.raises(ValueError, match="runs on tf_distrib's transport.*transport='tf'"):
        td.make_strategy(compression="powersgd", transport="tf")


def powersgd_sums(directory, steps, mode, native_off=None):
    """Runs in each worker: `steps` PowerSGD all-reduces of fixed gradients, eagerly; the
    worker `native_off` may not use the native ops."""
    import tensorflow as tf

    from tf_distrib import transport
    from tf_distrib.cross_device.powersgd import PowerSGDAllReduce

    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    world = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    if rank == native_off:
        os.environ["TF_DISTRIB_NATIVE_SUM"] = "0"
    t = transport.connect(rank, [f"worker:{r}" for r in range(world)], "127.0.0.1",
                          transport.FileStore(directory), secret=b"s", mode=mode, timeout=30)
    rng = np.random.default_rng(rank)
    u, v = np.random.default_rng(99).standard_normal((2, 96, 1)).astype(np.float32)
    grads = {"low rank": (u @ v[:64].T) * np.float32(rank + 1),  # every worker's: rank 1
             "full rank": rng.standard_normal((96, 80)).astype(np.float32),
             "vector": rng.standard_normal(80).astype(np.float32)}
    reduce = PowerSGDAllReduce(PowerSGD(rank=2, start_step=1, min_size=0), t)
    try:
        sums = [[np.array(s) for s in reduce([tf.constant(g) for g in grads.values()])]
                for _ in range(steps)]
        return {"grads": grads, "sums": sums, "state": reduce.worker_state(),
                "native": t.op_library is not None}
    finally:
        t.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, mode, native_off", [(2, "shm", None), (3, "tcp", 1)])
def test_sums_are_equal_on_every_worker_and_error_feedback_loses_nothing(tmp_path, world,
                                                                          mode, native_off):
    steps = 12
    results = [w.value for w in run_workers(powersgd_sums, world, args=(
        str(tmp_path), steps, mode, native_off), quiet=True)]
    # The native ops and TensorFlow's round differently: one worker without them, and
    # none uses them.
    assert [r["native"] for r in results] == [native_off is None] * world
    for other in results[1:]:  # bitwise the same sums on every worker
        for mine, theirs in zip(results[0]["sums"], other["sums"], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                np.testing.assert_array_equal(a, b)
    true = [sum(r["grads"][name] for r in results) for name in results[0]["grads"]]
    first, *compressed = results[0]["sums"]
    for got, want in zip(first, true, strict=True):  # step 0: sent whole (start_step=1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # A rank-1 sum is rebuilt by rank 2 at once; vectors travel whole.
    np.testing.assert_allclose(compressed[0][0], true[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(compressed[0][2], true[2], rtol=1e-6, atol=1e-6)
    # A full-rank sum is not, but nothing is lost: what the steps' sums missed of the
    # true sums' total is in the workers' residuals, to be sent in later steps.
    residual = sum(r["state"]["residual/1"] for r in results)
    applied = sum(s[1] for s in results[0]["sums"])
    np.testing.assert_allclose(applied + residual, steps * true[1], rtol=1e-4, atol=1e-3)
    assert sorted(results[0]["state"]) == ["q/0", "q/1", "residual/0", "residual/1", "steps"]


@pytest.mark.multiprocess
def test_a_killed_powersgd_job_resumes_bitwise_with_every_workers_residuals(tmp_path):
    kwargs = {"compression": PowerSGD(rank=2, start_step=3, min_size=0), "epochs": 2}
    reference = run_workers(train_with_backup, 2, args=(str(tmp_path / "ref"),),
                            kwargs=kwargs, quiet=True)
    np.testing.assert_array_equal(reference[0].value["weights"][0],
                                  reference[1].value["weights"][0])
    assert reference[0].value["worker_state"] == ["q/0", "residual/0", "steps"]
    result = launch(train_with_backup, 2, args=(str(tmp_path / "b"),),
                    kwargs={**kwargs, "kill_at": 45, "kill_worker": 1}, max_restarts=1,
                    quiet=True, timeout=300)
    assert result.exit_code == 0, result.failure_report()
    assert [w.value["restored_step"] for w in result.workers] == [40, 40]
    for worker, ref in zip(result.workers, reference, strict=True):
        for got, want in zip(worker.value["weights"], ref.value["weights"], strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.multiprocess
def test_powersgd_with_gradient_accumulation_runs_its_two_rounds_once_per_update():
    from tests._accumulation import STEPS_PER_EPOCH
    from tests._accumulation import train as accumulate

    steps = 4
    a, b = (w.value for w in run_workers(accumulate, 2, args=(64, steps, "sgd"), kwargs={
        "compression": PowerSGD(rank=2, start_step=0, min_size=0)}, quiet=True))
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        np.testing.assert_array_equal(wa, wb)
    updates = 2 * STEPS_PER_EPOCH
    assert a["updates"] == updates
    # Every micro-step reduces its logged loss; every update the P and the Q factors.
    assert a["collectives"] == updates * steps + 2 * updates
    assert a["loss"][-1] < a["loss"][0]
