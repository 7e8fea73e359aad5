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
    # A worker's residual: its last M less its share of the last sum.
    state = [r["state"] for r in results]
    residual = sum(s["matrix/1"] - s["p_hat/1"] @ s["q/1"] / world for s in state)
    applied = sum(s[1] for s in results[0]["sums"])
    np.testing.assert_allclose(applied + residual, steps * true[1], rtol=1e-4, atol=1e-3)
    assert sorted(state[0]) == ["matrix/0", "matrix/1", "p_hat/0", "p_hat/1", "q/0", "q/1",
                                "steps"]


# No accumulation here: Keras' own step divides the sums by K, the fused one its
# learning rate (test_accumulation), and the models pass their residuals on.
SGD_SETTINGS = {"plain": {}, "momentum": {"momentum": 0.9},
                "Nesterov": {"momentum": 0.5, "nesterov": True}}


def fit_powersgd_with_sgd(keras_step):
    """Trains a model under PowerSGD for each of `SGD_SETTINGS` in turn, with Keras' SGD
    (its step fused into the native ops that rebuild the sums) or, with `keras_step`, an
    SGD whose `update_step` is overridden (Keras' own step on the sums); then the first
    settings again, under the same strategy. Returns each model's weights' digest and how
    many fused steps each traced."""
    import hashlib

    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.cross_device.powersgd import PowerSGDAllReduce

    traced = []
    fused = PowerSGDAllReduce.sgd
    PowerSGDAllReduce.sgd = lambda self, *a: traced.append(1) or fused(self, *a)

    class KerasSGD(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)

    strategy = td.make_strategy(compression=PowerSGD(rank=2, start_step=3, min_size=0))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((512, 20)).astype("float32"), rng.integers(0, 5, 512)
    data = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                      64)
    report = {"native": strategy.transport.op_library is not None}
    for label, kwargs in [*SGD_SETTINGS.items(), ("plain, again", SGD_SETTINGS["plain"])]:
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((20,)),
                                      keras.layers.Dense(48, activation="relu"),
                                      keras.layers.Dense(5)])
            optimizer = KerasSGD if keras_step else keras.optimizers.SGD
            model.compile(optimizer(0.05, **kwargs),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = len(traced)
        model.fit(data, epochs=2, verbose=0)
        report[f"traced {label}"] = len(traced) - before
        report[f"digest {label}"] = hashlib.sha256(
            b"".join(w.numpy().tobytes() for w in model.weights)).hexdigest()
    return report


@pytest.mark.multiprocess
def test_keras_sgd_fused_into_powersgds_native_ops_steps_bitwise_as_keras():
    fused, keras_step = ([w.value for w in run_workers(fit_powersgd_with_sgd, 2, args=(k,),
                                                       quiet=True, timeout=240)]
                         for k in (False, True))
    assert fused[0] == fused[1] and keras_step[0] == keras_step[1]  # workers agree
    assert fused[0]["native"], fused[0]
    for label in SGD_SETTINGS:
        assert fused[0][f"digest {label}"] == keras_step[0][f"digest {label}"], label
        assert fused[0][f"traced {label}"] >= 1 and keras_step[0][f"traced {label}"] == 0
    # Each model has a PowerSGD state of its own: the same model trained again under the
    # same strategy starts from no residual and the warm-up's first step, as the first did.
    for report in fused[0], keras_step[0]:
        assert report["digest plain, again"] == report["digest plain"]


@pytest.mark.multiprocess
def test_a_killed_powersgd_job_resumes_bitwise_with_every_workers_residuals(tmp_path):
    kwargs = {"compression": PowerSGD(rank=2, start_step=3, min_size=0), "epochs": 2}
    reference = run_workers(train_with_backup, 2, args=(str(tmp_path / "ref"),),
                            kwargs=kwargs, quiet=True)
    np.testing.assert_array_equal(reference[0].value["weights"][0],
                                  reference[1].value["weights"][0])
    assert reference[0].value["worker_state"] == ["matrix/0", "p_hat/0", "q/0", "steps"]
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
