"""Model parallelism on 2 and 4 logical CPUs, against the same model on one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_distrib as td
from tf_distrib.model_parallel import balance, memory_per_device, pipeline

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.0),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(4),
    ])


def data():
    x = np.random.default_rng(0).standard_normal((64, 16)).astype("float32")
    y = np.random.default_rng(1).integers(0, 4, 64)
    return x, y


def compiled(model):
    model.compile(keras.optimizers.Adam(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("num_devices", [2, 4])
def test_same_function_gradients_and_placement(num_devices):
    model = make_model()
    piped = pipeline(model, DEVICES[:num_devices])
    x, y = data()
    np.testing.assert_allclose(piped(x), model(x), atol=1e-6)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    grads = []
    for m in (model, piped):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x))
        grads.append(tape.gradient(loss, m.trainable_weights))
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for k, stage in enumerate(piped.stages):
        assert stage.weights, f"stage {k} holds no weights"
        for w in stage.weights:
            assert w.value.device.endswith(f"CPU:{k}"), (k, w.path, w.value.device)


@pytest.mark.parametrize("num_devices", [2, 4])
def test_fit_matches_single_device_training(num_devices):
    x, y = data()
    single = compiled(make_model())
    piped = compiled(pipeline(make_model(), DEVICES[:num_devices]))
    for m in (single, piped):
        m.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    for a, b in zip(single.get_weights(), piped.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # Optimizer slots (Adam: 2 per variable) live with their stage's variables.
    slots = [v for v in piped.optimizer.variables
             if "_momentum" in v.path or "_velocity" in v.path]
    assert len(slots) == 2 * len(piped.trainable_weights)
    for k in range(num_devices):
        stage_slots = [v for v in slots if f"stage_{k}_" in v.path]
        assert stage_slots and all(v.value.device.endswith(f"CPU:{k}") for v in stage_slots)
    usage = memory_per_device(piped)
    assert all(any(d.endswith(f"CPU:{k}") for d in usage) for k in range(num_devices))


def test_microbatches_give_the_same_update_as_one_batch():
    x, y = data()
    one = compiled(pipeline(make_model(), DEVICES[:2], num_microbatches=1))
    four = compiled(pipeline(make_model(), DEVICES[:2], num_microbatches=4))
    for m in (one, four):
        m.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(one.get_weights(), four.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_explicit_stages_and_balancing():
    model = make_model()
    layers = model.layers
    piped = pipeline([layers[:3], layers[3:]], DEVICES[:2])
    assert [len(s.layers) for s in piped.stages] == [3, 2]
    np.testing.assert_allclose(piped(data()[0]), model(data()[0]), atol=1e-6)
    assert balance([10, 10, 10, 10], 2) == [2, 2]
    assert balance([1090, 4160, 0, 2080, 132], 4) == [1, 1, 2, 1]
    assert balance([5, 100, 5], 3) == [1, 1, 1]


@pytest.mark.parametrize("make, error, message", [
    (lambda: pipeline(make_model(), DEVICES * 2), ValueError, "only 5 layers"),
    (lambda: pipeline(make_model(), ["/cpu:9"]), ValueError, "Unknown device '/cpu:9'"),
    (lambda: pipeline(make_model(), ["/gpu:0"]), ValueError, "Unknown device '/gpu:0'"),
    (lambda: pipeline(make_model(), "/cpu:0"), ValueError, "non-empty list"),
    (lambda: pipeline(make_model(), DEVICES[:2], num_microbatches=0), ValueError,
     "num_microbatches must be"),
    (lambda: pipeline(keras.Sequential([keras.layers.Dense(2)]), DEVICES[:1]), ValueError,
     "not built"),
    (lambda: pipeline(keras.Model(*(lambda i: (i, keras.layers.Dense(2)(i)))(
        keras.Input((3,)))), DEVICES[:1]), ValueError, "splits a keras.Sequential"),
    (lambda: pipeline([make_model().layers[:2]], DEVICES[:2]), ValueError, "1 layer groups"),
])
def test_bad_input(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_microbatches_must_divide_the_batch():
    x, y = data()
    piped = compiled(pipeline(make_model(), DEVICES[:2], num_microbatches=3))
    with pytest.raises(ValueError, match="num_microbatches=3 does not divide the batch of 16"):
        piped.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True),
                  verbose=0)


def test_layer_that_cannot_be_placed():
    class NoConfig(keras.layers.Layer):
        def __init__(self, scale):  # no get_config: cannot be re-created
            super().__init__()
            self.scale = scale

        def call(self, x):
            return x * self.scale

    model = keras.Sequential([keras.Input((4,)), NoConfig(2.0), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="cannot be placed on a device"):
        td.model_parallel.pipeline(model, DEVICES[:2])
