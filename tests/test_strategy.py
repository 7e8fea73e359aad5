import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_distrib as td
from tests.conftest import LOGICAL_CPUS
from tf_distrib.datasets import build_model, make_data


def test_make_strategy_uses_every_logical_cpu(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = td.make_strategy()
    assert isinstance(strategy, td.HostMirroredStrategy)
    assert strategy.num_replicas_in_sync == LOGICAL_CPUS
    # TF's default on CPU is a ring collective that halves throughput.
    assert isinstance(strategy.extended._cross_device_ops, tf.distribute.ReductionToOneDevice)


def test_fit_converges_on_four_replicas(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    keras.utils.set_random_seed(0)
    strategy = td.make_strategy()
    x, y = make_data(1024)
    with strategy.scope():
        model = build_model()
    dataset = td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices((x, y)), 64, shuffle_buffer=1024, seed=0)
    history = model.fit(dataset, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.25 * losses[0]
    assert history.history["accuracy"][-1] > 0.9
    assert model.evaluate(x, y, verbose=0)[1] > 0.9


def test_custom_cross_device_ops_is_used(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    ops = tf.distribute.HierarchicalCopyAllReduce()
    assert td.make_strategy(ops).extended._cross_device_ops is ops
    with pytest.raises(TypeError, match="CrossDeviceOps"):
        td.make_strategy("ring")


def test_use_logical_cpus_is_idempotent_and_late_calls_explain_the_fix():
    td.use_logical_cpus(LOGICAL_CPUS)
    with pytest.raises(RuntimeError, match="came too late.*before any tensor"):
        td.use_logical_cpus(LOGICAL_CPUS + 1)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            td.use_logical_cpus(bad)


@pytest.mark.parametrize("tf_config, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
                 "task": {"type": "worker", "index": 0}}), "role\\(s\\) \\['ps'\\]"),
])
def test_bad_tf_config_fails_before_tensorflow_starts_a_server(monkeypatch, tf_config, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(td.ClusterConfigError, match=message):
        td.make_strategy()


def test_multi_worker_rejects_custom_cross_device_ops():
    spec = td.cluster.parse_tf_config({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                       "task": {"type": "worker", "index": 0}})
    with pytest.raises(ValueError, match="cannot use a custom cross_device_ops"):
        td.make_strategy(tf.distribute.ReductionToOneDevice(), cluster=spec)


@pytest.mark.parametrize("kwargs", [{"communication_timeout": 0}, {"startup_timeout": -1}])
def test_bad_timeouts(kwargs):
    with pytest.raises(ValueError, match="must be > 0"):
        td.make_strategy(**kwargs)


def test_the_keras_fix_is_scoped_to_tf_distrib_strategies():
    fixed = td.KerasMultiWorkerMirroredStrategy
    assert issubclass(fixed, tf.distribute.MultiWorkerMirroredStrategy)
    assert "reduce" in vars(fixed)
    for cls in (tf.distribute.MultiWorkerMirroredStrategy, tf.distribute.MirroredStrategy):
        assert cls.reduce is tf.distribute.Strategy.reduce
    # Plain MirroredStrategy still reduces structures and axes exactly as before.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    values = strategy.run(lambda: (tf.ones([3]), tf.constant(2.0)))
    total = strategy.reduce("SUM", values, axis=None)
    np.testing.assert_allclose(total[0], [2, 2, 2])
    assert float(total[1]) == 4.0


@pytest.mark.multiprocess
def test_one_cpu_trains_as_the_default_strategy_without_stopping_at_each_epoch():
    from tests._training import train_on_one_cpu
    from tf_distrib.testing import run_workers

    [worker] = run_workers(train_on_one_cpu, 1, quiet=True, timeout=180)
    result = worker.value
    assert result["strategy"] == "HostOneDeviceStrategy"
    # Bitwise the default strategy's weights, losses and metrics, with and without
    # gradient accumulation.
    assert result["same"] == {None: True, 4: True}
    # The spent iterator's teardown (which waits for tf.data's autotuning thread: ~1 s per
    # epoch on one core) runs off the training thread, and no batch is copied per device.
    assert result["torn_down"] == ["tf_distrib-iterator-reaper"]
    assert result["iterator"] == "OwnedIterator"
    assert result["warnings"] == [
        "tf_distrib: make_strategy(compression=..., bucket_bytes=...) has no effect on one "
        "CPU: there is nothing to reduce across devices; for several CPU replicas call "
        "td.use_logical_cpus(n) before TensorFlow starts. Drop the argument for one-device "
        "runs."]
