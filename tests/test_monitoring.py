"""Throughput, ChiefOnly, learning-rate scaling and `tf-distrib doctor`."""

import json
import subprocess
import sys
import time

import keras
import pytest
import tensorflow as tf

import tf_distrib as td
from tf_distrib.cluster import local_tf_configs
from tf_distrib.datasets import build_model, make_data
from tf_distrib.testing import run_workers


class EpochWallClock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.begin = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = getattr(self, "seconds", []) + [time.perf_counter() - self.begin]


def test_throughput_agrees_with_wall_time():
    strategy = td.make_strategy()
    with strategy.scope():
        model = build_model()
    dataset = td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices(make_data(4096)), 64)
    throughput, clock = td.callbacks.Throughput(64), EpochWallClock()
    history = model.fit(dataset, epochs=3, verbose=0, callbacks=[throughput, clock])
    logs = history.history
    assert throughput.warmup_excluded == 2
    for epoch in (1, 2):  # no tracing in these epochs: every step counted
        wall = 64 * 64 / clock.seconds[epoch]
        assert abs(logs["examples_per_sec"][epoch] / wall - 1) < 0.10
        assert logs["step_time"][epoch] * 64 < clock.seconds[epoch]
        assert logs["step_time_p50"][epoch] <= logs["step_time_p95"][epoch]
        assert logs["examples_per_sec_per_replica"][epoch] == pytest.approx(
            logs["examples_per_sec"][epoch] / 4)


def test_throughput_validation():
    with pytest.raises(ValueError, match="global_batch_size"):
        td.callbacks.Throughput(0)
    with pytest.raises(ValueError, match="warmup_steps"):
        td.callbacks.Throughput(8, warmup_steps=-1)
    with pytest.raises(TypeError, match="wraps a keras.callbacks.Callback"):
        td.callbacks.ChiefOnly(print)


def chief_only_job(directory):
    import os

    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import build_model, make_data

    index = os.environ["TF_DISTRIB_WORKER_INDEX"]
    strategy = td.make_strategy()
    with strategy.scope():
        model = build_model()
    dataset = td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices(make_data(512)), 64)
    model.fit(dataset, epochs=2, verbose=td.callbacks.chief_verbose(2), callbacks=[
        td.callbacks.ChiefOnly(keras.callbacks.CSVLogger(f"{directory}/log-{index}.csv")),
        td.callbacks.ChiefOnly(keras.callbacks.ModelCheckpoint(
            f"{directory}/ckpt-{index}.weights.h5", save_weights_only=True)),
    ])
    return td.callbacks.is_chief()


@pytest.mark.multiprocess
def test_chief_only_writes_from_the_chief_and_one_progress_bar(tmp_path):
    workers = run_workers(chief_only_job, 2, args=(str(tmp_path),), quiet=True)
    assert [w.value for w in workers] == [True, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0.weights.h5", "log-0.csv"]
    assert "".join(workers[0].output).count("Epoch 2/2") == 1
    assert "Epoch" not in "".join(workers[1].output)


def test_scale_learning_rate():
    assert td.lr.scale_learning_rate(0.1, 256, 8192) == pytest.approx(3.2)
    assert td.lr.scale_learning_rate(0.1, 256, 1024, rule="sqrt") == pytest.approx(0.2)
    with pytest.raises(ValueError, match="rule must be one of"):
        td.lr.scale_learning_rate(0.1, 256, 1024, rule="cubic")
    with pytest.raises(ValueError, match="global_batch must be an integer >= 1"):
        td.lr.scale_learning_rate(0.1, 256, 0)


def test_linear_warmup_matches_the_formula_and_round_trips():
    decay = keras.optimizers.schedules.ExponentialDecay(3.2, decay_steps=100, decay_rate=0.5)
    for after, target in ((3.2, lambda s: 3.2), (decay, lambda s: 3.2 * 0.5 ** (s / 100))):
        schedule = td.lr.LinearWarmup(after, warmup_steps=10, initial_learning_rate=0.1)
        for step in (0, 1, 5, 9):
            assert float(schedule(step)) == pytest.approx(0.1 + (3.2 - 0.1) * step / 10)
        for step in (10, 11, 50, 210):
            assert float(schedule(step)) == pytest.approx(target(step - 10), rel=1e-6)
        config = keras.saving.serialize_keras_object(schedule)
        restored = keras.saving.deserialize_keras_object(json.loads(json.dumps(config)))
        assert isinstance(restored, td.lr.LinearWarmup)
        for step in (0, 7, 10, 99):
            assert float(restored(step)) == pytest.approx(float(schedule(step)))
    with pytest.raises(ValueError, match="warmup_steps"):
        td.lr.LinearWarmup(1.0, warmup_steps=0)


def test_warmup_trains_in_fit():
    model = build_model()
    model.compile(keras.optimizers.SGD(td.lr.LinearWarmup(0.05, warmup_steps=5)),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(*make_data(256), batch_size=32, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]


def doctor(tf_config, *flags):
    env = {k: v for k, v in __import__("os").environ.items() if k != "TF_CONFIG"}
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    return subprocess.run([sys.executable, "-m", "tf_distrib.doctor", *flags], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.multiprocess
def test_doctor_healthy_cluster_exits_0():
    done = doctor(json.dumps(local_tf_configs(2)[1]))
    assert done.returncode == 0, done.stdout
    assert "this task worker:1" in done.stdout and "no problems found" in done.stdout
    assert "devices: 1 CPU" in done.stdout and "keras 3." in done.stdout


@pytest.mark.multiprocess
def test_doctor_broken_tf_config_exits_1():
    done = doctor('{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"index": 0}}',
                  "--no-devices")
    assert done.returncode == 1
    assert "task.type is missing" in done.stdout


@pytest.mark.multiprocess
def test_doctor_reports_a_busy_port_and_warns_about_public_addresses():
    import socket

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = {"cluster": {"worker": [f"127.0.0.1:{port}", "34.1.2.3:2222"]},
                  "task": {"type": "worker", "index": 0}}
        # probe_peers=False: no packet is sent to the public address.
        lines, problems = td.doctor.check({"TF_CONFIG": json.dumps(config)}, devices=False,
                                          probe_peers=False)
    assert any(f"port {port} of this task is in use" in p for p in problems)
    assert any("34.1.2.3" in line and "no authentication" in line for line in lines)


@pytest.mark.multiprocess
def test_doctor_side_car_evaluator_outside_the_cluster():
    config = {"cluster": {"chief": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]},
              "task": {"type": "evaluator", "index": 0}}
    lines, problems = td.doctor.check({"TF_CONFIG": json.dumps(config)}, devices=False,
                                      probe_peers=False)
    assert problems == []
    assert any("evaluator:0 outside the cluster" in line for line in lines)
