"""GPU readiness: tests that need NVIDIA GPUs (`make gpu-check`); elsewhere they skip.

Each runs in a worker process of its own, which splits a GPU into logical ones before
TensorFlow starts (the pytest process has already fixed its devices: 4 logical CPUs).
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_distrib.testing import run_workers

GPUS = len(tf.config.list_physical_devices("GPU"))
pytestmark = pytest.mark.gpu


def needs(count):
    return pytest.mark.skipif(GPUS < count, reason=f"needs {count} NVIDIA GPU(s); this "
                                                   f"machine has {GPUS}")


def split_first_gpu(parts=2, megabytes=4096):
    """Splits GPU 0 into `parts` logical GPUs; returns their names."""
    import tensorflow as tf

    gpu = tf.config.list_physical_devices("GPU")[0]
    tf.config.set_logical_device_configuration(
        gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=megabytes)] * parts)
    return [d.name for d in tf.config.list_logical_devices("GPU")]


def mixed_precision_fit(compression, accumulation):
    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import make_data

    split_first_gpu()
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = td.make_strategy(cross_device_ops=tf.distribute.ReductionToOneDevice(),
                                compression=compression)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(4, dtype="float32")])
        model.compile(keras.optimizers.SGD(0.05, gradient_accumulation_steps=accumulation),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices(make_data(2048)), 128)
    history = model.fit(dataset, epochs=3, verbose=0)
    return {"loss": history.history["loss"], "replicas": strategy.num_replicas_in_sync,
            "optimizer": type(model.optimizer).__name__}


@needs(1)
@pytest.mark.parametrize("compression, accumulation", [(None, None), ("fp16", None),
                                                       (None, 2)])
def test_mixed_float16_with_loss_scaling_under_make_strategy(compression, accumulation):
    [worker] = run_workers(mixed_precision_fit, 1, args=(compression, accumulation),
                           startup_timeout=None, quiet=True)
    result = worker.value
    assert result["replicas"] == 2 and result["optimizer"] == "LossScaleOptimizer"
    assert all(np.isfinite(result["loss"])) and result["loss"][-1] < result["loss"][0]


def chosen_collectives(one_gpu_per_worker=False):
    import os

    if one_gpu_per_worker:
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["TF_DISTRIB_WORKER_INDEX"]
    import tensorflow as tf

    import tf_distrib as td

    strategy = td.make_strategy()
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return str(strategy.extended._communication_options.implementation)
    return type(strategy.extended._cross_device_ops).__name__


@needs(2)
def test_nccl_is_chosen_on_two_gpus():
    [mirrored] = run_workers(chosen_collectives, 1, startup_timeout=None, quiet=True)
    assert mirrored.value == "NcclAllReduce"
    workers = run_workers(chosen_collectives, 2, args=(True,), quiet=True)
    assert [w.value for w in workers] == ["CommunicationImplementation.NCCL"] * 2


def custom_ops_against_reference():
    devices = split_first_gpu()
    import tensorflow as tf

    from tests.test_cross_device import DTYPES, OPS, check, reference, replica_arrays, to_tf

    failures = []
    for name, (make_op, eps) in OPS.items():
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=make_op())
        arrays = replica_arrays(2)
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx, a=arrays: to_tf(*a[ctx.replica_id_in_sync_group]))
        expected, magnitudes = reference(arrays, "SUM")
        floating = [(v, e, m, d) for v, e, m, d in zip(values, expected, magnitudes,
                                                       [*DTYPES, tf.float32], strict=True)
                    if d != tf.int32]
        reduced = strategy.extended.batch_reduce_to("SUM", [(v, v) for v, *_ in floating])
        for r, (_, e, m, d) in zip(reduced, floating, strict=True):
            try:
                check(r, e, m, d, eps, 2, strategy)
            except AssertionError as error:
                failures.append(f"{name} {d.name}: {error}")
    return failures


@needs(1)
def test_cross_device_ops_on_logical_gpus():
    [worker] = run_workers(custom_ops_against_reference, 1, startup_timeout=None, quiet=True)
    assert worker.value == []


def pipeline_on_gpus():
    devices = split_first_gpu()
    import keras
    import numpy as np

    import tf_distrib as td

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,))] + [keras.layers.Dense(64, activation="relu")
                                                      for _ in range(4)]
                             + [keras.layers.Dense(1)])
    x = np.random.default_rng(0).standard_normal((256, 32)).astype("float32")
    single = model(x).numpy()
    piped = td.model_parallel.pipeline(model, devices, num_microbatches=2)
    placed = {v.device.split("device:")[-1] for v in piped.trainable_variables}
    return {"max_difference": float(np.abs(piped(x).numpy() - single).max()),
            "devices": sorted(placed)}


@needs(1)
def test_model_parallel_on_logical_gpus():
    [worker] = run_workers(pipeline_on_gpus, 1, startup_timeout=None, quiet=True)
    assert worker.value["max_difference"] < 1e-5
    assert worker.value["devices"] == ["GPU:0", "GPU:1"]
