"""Keras 3 model.fit under MultiWorkerMirroredStrategy, in real worker processes."""

import numpy as np
import pytest

from tf_distrib.demo import train
from tf_distrib.testing import WorkersFailed, run_workers


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


def test_two_workers_match_mirrored_on_two_logical_cpus():
    workers = run_workers(train, 2, args=(2, 64, 1, None, True), timeout=240)
    [mirrored] = run_workers(train, 1, args=(2, 64, 1, 2, True), timeout=240)
    a, b = (w.value for w in workers)
    ref = mirrored.value
    assert (a["workers"], a["replicas"]) == (2, 2)
    assert (ref["workers"], ref["replicas"]) == (1, 2)
    assert a["loss"] == b["loss"]
    np.testing.assert_allclose(a["loss"], ref["loss"], rtol=1e-5)
    for wa, wb, wr in zip(a["weights"], b["weights"], ref["weights"], strict=True):
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_allclose(wa, wr, atol=1e-5)
    assert a["loss"][-1] < a["loss"][0]


def test_plain_mwms_fit_still_fails_upstream():
    """Canary: when this fails, Keras fixed keras-team/keras#20585 and
    KerasMultiWorkerMirroredStrategy.reduce can be dropped."""
    with pytest.raises(WorkersFailed) as failure:
        run_workers(train_with_plain_mwms, 2, timeout=180, quiet=True)
    output = "".join(line for w in failure.value.workers for line in w.output)
    assert "PerReplica" in output or "Invalid reduction dimension" in output
