"""Under make_strategy()'s strategies `fit` steps without Keras' per-step Optional, and
trains, logs and ends its epochs exactly as Keras' own step function does."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_distrib as td
from tf_distrib.datasets import build_model, make_data
from tf_distrib.strategy import _step_function

GLOBAL_BATCH = 64


class CountSteps(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def _fit(strategy, data, direct: bool, steps_per_execution: int = 1, steps=None):
    """A model trained under `strategy`, through the direct step or Keras' own."""
    setattr(strategy, _step_function._ATTRIBUTE, direct)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
    if steps_per_execution != 1:
        model.compile(optimizer=model.optimizer, loss=model.loss, metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
    counter = CountSteps()
    history = model.fit(data, epochs=2, steps_per_epoch=steps, verbose=0, callbacks=[counter])
    return model, history.history, counter.steps


@pytest.mark.parametrize("data_path", ["distribute_dataset", "plain"])
def test_fit_steps_directly_with_keras_arithmetic_and_epoch_ends(monkeypatch, data_path):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = td.make_strategy()
    x, y = make_data(1000)  # 15 full global batches and a partial one
    source = tf.data.Dataset.from_tensor_slices((x, y))
    if data_path == "plain":  # its length unknown to Keras: the end of the data ends an epoch
        data, steps, expected_steps = source.batch(GLOBAL_BATCH), None, 16
    else:
        data = td.data.distribute_dataset(strategy, source, GLOBAL_BATCH, repeat=True)
        steps = expected_steps = data.steps_per_epoch
    direct, direct_logs, direct_steps = _fit(strategy, data, True, steps=steps)
    own, own_logs, own_steps = _fit(strategy, data, False, steps=steps)
    assert direct.train_function.__name__ == "direct_function"
    assert own.train_function.__name__ != "direct_function"
    assert direct_steps == own_steps == expected_steps
    assert direct_logs == own_logs
    for mine, theirs in zip(direct.get_weights(), own.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert direct.evaluate(x, y, verbose=0) == own.evaluate(x, y, verbose=0)


def test_several_steps_per_execution_and_other_strategies_run_keras_function(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = td.make_strategy()
    x, y = make_data(1024)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    direct, direct_logs, _ = _fit(strategy, data, True, steps_per_execution=4)
    own, own_logs, _ = _fit(strategy, data, False, steps_per_execution=4)
    assert direct_logs == own_logs
    for mine, theirs in zip(direct.get_weights(), own.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    default = build_model()  # TensorFlow's default strategy: Keras' function, untouched
    default.fit(x, y, epochs=1, verbose=0)
    assert default.train_function.__name__ != "direct_function"
