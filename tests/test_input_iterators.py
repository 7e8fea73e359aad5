"""The input iterators of tf_distrib's strategies: glibc's mmap threshold after TensorFlow
lowers it (tf_distrib.strategy._malloc), and spent iterators torn down off the training thread
(tf_distrib.strategy._input_iterators)."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tf_distrib as td
from tests._training import tear_down_a_spent_iterator
from tf_distrib.strategy import _malloc

# TensorFlow lowers the threshold once per process (when it first builds an input
# iterator's GeneratorDataset kernel), so each measurement runs in a fresh process.
_MEASURE = """
import json, resource
import numpy as np, tensorflow as tf
import tf_distrib as td

def faults_per_buffer(count=40):
    # A 1 MiB buffer, allocated and filled as a training step's buffers are: 256 pages.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(count):
        np.ones((1 << 20) // 8)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / count

def iterate(strategy):
    next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))))

td.use_logical_cpus(2)
faults = {"before": faults_per_buffer()}
iterate(tf.distribute.MirroredStrategy(tf.config.list_logical_devices("CPU")))
faults["tensorflow"] = faults_per_buffer()
iterate(td.make_strategy())
faults["tf_distrib"] = faults_per_buffer()
print(json.dumps(faults))
"""


def _page_faults_per_buffer(**env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    done = subprocess.run([sys.executable, "-c", _MEASURE], env={**environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_make_strategy_iterators_keep_large_buffers_mapped():
    faults = _page_faults_per_buffer()
    assert faults["before"] < 20
    # If this fails, TensorFlow no longer lowers the threshold: drop tf_distrib.strategy._malloc.
    assert faults["tensorflow"] > 200
    assert faults["tf_distrib"] < 20


def test_zero_keeps_tensorflows_threshold():
    faults = _page_faults_per_buffer(TF_DISTRIB_MMAP_THRESHOLD="0")
    assert faults["tensorflow"] > 200
    assert faults["tf_distrib"] > 200


def test_distributed_datasets_keep_their_type(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = td.make_strategy()
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))
    assert isinstance(dataset, tf.distribute.DistributedDataset)
    from_function = strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.range(8).batch(2))
    assert isinstance(from_function, tf.distribute.DistributedDataset)
    values = strategy.experimental_local_results(next(iter(dataset)))
    assert [int(tf.reduce_sum(v)) for v in values] == [0, 1, 2, 3]


@pytest.mark.parametrize("value", ["33554433", "-1", "lots"])
def test_bad_threshold_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("TF_DISTRIB_MMAP_THRESHOLD", value)
    with pytest.raises(ValueError, match="TF_DISTRIB_MMAP_THRESHOLD"):
        _malloc.threshold()


def test_spent_iterators_are_torn_down_off_the_training_thread(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    torn_down, fresh = tear_down_a_spent_iterator(
        td.make_strategy().experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4)))
    assert torn_down == ["tf_distrib-iterator-reaper"]
    assert sorted(int(tf.reduce_sum(v)) for v in
                  td.make_strategy().experimental_local_results(next(fresh))) == [0, 1, 2, 3]


def iterate_a_plain_dataset_each_way():
    """Each epoch's batches of a dataset given to `fit`, and the iterators that made them:
    as tf_distrib distributes it, and through TF's MultiDeviceIterator (a caller's own
    InputOptions keep it); the same for `distribute_dataset`, one epoch."""
    import tensorflow as tf

    import tf_distrib as td

    strategy = td.make_strategy()
    dataset = tf.data.Dataset.range(70).batch(16)  # the last batch is partial
    seen = {}
    for way, options in (("tf_distrib", None), ("multi-device", tf.distribute.InputOptions(
            experimental_fetch_to_device=False))):
        distributed = strategy.experimental_distribute_dataset(dataset, options)
        epochs, kinds = [], set()
        for _ in range(2):  # a new iterator per epoch, as Keras makes them
            iterator = iter(distributed)
            kinds |= {type(worker._iterator).__name__ for worker in iterator._iterators}
            epochs.append([v.numpy().tolist() for batch in iterator
                           for v in strategy.experimental_local_results(batch)])
        seen[way] = {"iterators": sorted(kinds), "epochs": epochs}
    own = td.data.distribute_dataset(strategy, tf.data.Dataset.range(64), 16)
    seen["distribute_dataset"] = {
        "iterators": sorted({type(w._iterator).__name__ for w in iter(own)._iterators}),
        "epochs": [[v.numpy().tolist() for batch in own
                    for v in strategy.experimental_local_results(batch)]]}
    return seen


@pytest.mark.multiprocess
def test_one_device_workers_iterate_a_dataset_given_to_fit_with_plain_iterators():
    from tf_distrib.testing import run_workers

    workers = [w.value for w in run_workers(iterate_a_plain_dataset_each_way, 2, quiet=True,
                                            timeout=180)]
    for seen in workers:
        # A MultiDeviceIterator rewrites the whole pipeline again each time one is made:
        # 0.23 s per iterator of a 160 MB dataset (tf_distrib._compat).
        assert seen["tf_distrib"]["iterators"] == ["OwnedIterator"]
        assert seen["distribute_dataset"]["iterators"] == ["OwnedIterator"]
        assert seen["multi-device"]["iterators"] == ["OwnedMultiDeviceIterator"]
        # ... and the batches are the same, partial batch included.
        assert seen["tf_distrib"]["epochs"] == seen["multi-device"]["epochs"]
    for epoch in range(2):
        examples = [x for seen in workers for batch in seen["tf_distrib"]["epochs"][epoch]
                    for x in batch]
        assert sorted(examples) == list(range(70))  # each example once per epoch
    examples = [x for seen in workers for batch in seen["distribute_dataset"]["epochs"][0]
                for x in batch]
    assert sorted(examples) == list(range(64))
