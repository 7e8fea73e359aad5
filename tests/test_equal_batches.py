"""A plain dataset whose global batches are all full skips TF's per-step data check."""

import numpy as np
import pytest
import tensorflow as tf

from tf_distrib.strategy._equal_batches import every_replica_has_a_batch
from tf_distrib.testing import run_workers

STEPS, BATCH, EPOCHS = 16, 64, 2


def _file_sharded(dataset):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    return dataset.with_options(options)


def _examples():  # built in the test, not at import: worker processes import this module
    return tf.data.Dataset.from_tensor_slices(np.zeros((1024, 4), "float32"))


PIPELINES = {
    "full batches": (lambda: _examples().batch(256), True),
    "shuffled and mapped, then batched and prefetched": (
        lambda: _examples().shuffle(64).map(tf.identity).batch(256).prefetch(2), True),
    "a range, cached": (lambda: tf.data.Dataset.range(512).batch(256).cache(), True),
    "a partial last batch": (lambda: _examples().batch(300), False),
    "a map after the batch (may change its size)": (
        lambda: _examples().batch(256).map(tf.identity), False),
    "filtered (count unknown)": (lambda: _examples().filter(lambda x: True).batch(256), False),
    "two sources": (lambda: _examples().concatenate(_examples().take(256)).batch(256), False),
    "sharded by file": (lambda: _file_sharded(_examples().batch(256)), False),
    "files": (lambda: tf.data.TFRecordDataset(["never-read"]).batch(2), False),
    "not batched": (_examples, False),
    "repeated": (lambda: _examples().batch(256).repeat(), False),
}


@pytest.mark.parametrize("name", PIPELINES)
def test_only_full_batches_of_examples_in_memory_are_proved(name):
    make, proved = PIPELINES[name]
    assert every_replica_has_a_batch(make()) is proved


def train_plain(mapped_on):
    """2 epochs of a plain dataset of full batches; `mapped_on`: the workers that add a
    map after the batch (which keeps TensorFlow's per-step check on that worker)."""
    import os

    import keras

    import tf_distrib as td
    from tf_distrib.datasets import make_data

    keras.utils.set_random_seed(0)
    strategy = td.make_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8)])
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = tf.data.Dataset.from_tensor_slices(make_data(STEPS * BATCH)).batch(BATCH)
    if int(os.environ["TF_DISTRIB_WORKER_INDEX"]) in mapped_on:
        dataset = dataset.map(lambda x, y: (x, y))
    history = model.fit(dataset, epochs=EPOCHS, verbose=0)
    return {"loss": history.history["loss"], "weights": [w.numpy() for w in model.weights],
            "collectives": strategy.transport.stats.collectives}


@pytest.mark.multiprocess
def test_two_workers_skip_the_check_only_where_both_proved_it():
    def run(mapped_on):
        a, b = (w.value for w in run_workers(train_plain, 2, args=(mapped_on,), quiet=True))
        assert a["loss"] == b["loss"] and a["collectives"] == b["collectives"]
        for wa, wb in zip(a["weights"], b["weights"], strict=True):
            np.testing.assert_array_equal(wa, wb)
        return a

    skipped, checked, one_unproved = run(()), run((0, 1)), run((1,))
    # The check is one collective per step, and one more that finds the first epoch's end
    # (Keras knows the second's length).
    assert checked["collectives"] - skipped["collectives"] == EPOCHS * STEPS + 1
    # Worker 0 alone could have skipped it: both keep it, and nobody waits forever.
    assert one_unproved["collectives"] == checked["collectives"]
    assert skipped["loss"] == checked["loss"]
    for ws, wc in zip(skipped["weights"], checked["weights"], strict=True):
        np.testing.assert_array_equal(ws, wc)
