"""Keras 3 model.fit under MultiWorkerMirroredStrategy, in real worker processes."""

import numpy as np
import pytest

from tf_distrib.demo import train
from tf_distrib.testing import WorkersFailed, run_workers
from tf_distrib.transport import native_build, native_sum

pytestmark = pytest.mark.multiprocess


def train_with_plain_mwms():
    import keras
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x = np.ones((64, 4), "float32")
    model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(16), verbose=0)


def train_and_count_sums_left_in_shared_memory(*args):
    import gc

    from tf_distrib.transport import Transport

    summary = train(*args)
    [transport] = [o for o in gc.get_objects() if isinstance(o, Transport)]
    return {**summary, "in_place": transport.stats.in_place,
            "native": transport.native is not None, "collectives": transport.stats.collectives}


def test_two_workers_match_mirrored_on_two_logical_cpus():
    workers = run_workers(train_and_count_sums_left_in_shared_memory, 2,
                          args=(2, 64, 1, None, True), timeout=240)
    [mirrored] = run_workers(train, 1, args=(2, 64, 1, 2, True), timeout=240)
    a, b = (w.value for w in workers)
    ref = mirrored.value
    assert (a["workers"], a["replicas"]) == (2, 2)
    assert (ref["workers"], ref["replicas"]) == (1, 2)
    assert a["loss"] == b["loss"]
    # The transport carried the gradients: through the native op where it is built
    # (`tf_distrib.transport.native_sum`), else reduce-scattered in place in shared memory.
    assert a["collectives"] == b["collectives"] > 0
    assert a["native"] == b["native"] == (native_sum.enabled()
                                             and native_build.compiler() is not None)
    assert a["native"] or a["in_place"] == b["in_place"] > 0
    np.testing.assert_allclose(a["loss"], ref["loss"], rtol=1e-5)
    for wa, wb, wr in zip(a["weights"], b["weights"], ref["weights"], strict=True):
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_allclose(wa, wr, atol=1e-5)
    assert a["loss"][-1] < a["loss"][0]


def fit_with_steps_per_execution():
    """Trains the same model with steps_per_execution 1 and 4; returns losses and weights."""
    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import make_data

    strategy = td.make_strategy()
    data = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices(
        make_data(512)), 32, repeat=True)
    out = {}
    for steps_per_execution in (1, 4):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8)])
            model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(
                from_logits=True), steps_per_execution=steps_per_execution)
        history = model.fit(data, epochs=2, steps_per_epoch=data.steps_per_epoch, verbose=0)
        out[steps_per_execution] = (history.history["loss"], [w.numpy() for w in model.weights])
    return out


def test_steps_per_execution_under_mwms():
    # keras-team/keras#19246: with plain MWMS, N > 1 fails with "You must feed a value for
    # placeholder tensor"; KerasMultiWorkerMirroredStrategy makes it run.
    a, b = (w.value for w in run_workers(fit_with_steps_per_execution, 2, timeout=240,
                                          quiet=True))
    for spe in (1, 4):
        assert a[spe][0] == b[spe][0]
        for wa, wb in zip(a[spe][1], b[spe][1], strict=True):
            np.testing.assert_array_equal(wa, wb)
    # Running 4 steps per call changes nothing in the arithmetic.
    np.testing.assert_allclose(a[4][0], a[1][0], rtol=1e-6)
    for w4, w1 in zip(a[4][1], a[1][1], strict=True):
        np.testing.assert_allclose(w4, w1, rtol=1e-5, atol=1e-6)


def test_plain_mwms_fit_still_fails_upstream():
    """Canary: when this fails, Keras fixed keras-team/keras#20585 and
    KerasMultiWorkerMirroredStrategy.reduce can be dropped."""
    with pytest.raises(WorkersFailed) as failure:
        run_workers(train_with_plain_mwms, 2, timeout=180, quiet=True)
    output = "".join(line for w in failure.value.workers for line in w.output)
    assert "PerReplica" in output or "Invalid reduction dimension" in output
