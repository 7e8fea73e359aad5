"""Sharding: every id exactly once per epoch (minus the reported remainder)."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tf_distrib as td
from tests.conftest import LOGICAL_CPUS
from tf_distrib.testing import run_workers

N = 1000            # ids 0..N-1; N is not a multiple of the global batch
GLOBAL_BATCH = 32
FILE_COUNTS = (1, 3, 8)


def write_id_files(directory, num_files):
    """Writes ids 0..N-1 into `num_files` TFRecord files of unequal sizes."""
    cuts = np.sort(np.random.default_rng(num_files).choice(np.arange(1, N), num_files - 1,
                                                           replace=False))
    paths = []
    for i, chunk in enumerate(np.split(np.arange(N), cuts)):
        path = str(directory / f"ids-{num_files}-{i:02d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for value in chunk:
                example = tf.train.Example(features=tf.train.Features(feature={
                    "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))}))
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def read_ids(path):
    return tf.data.TFRecordDataset(path).map(
        lambda r: tf.io.parse_single_example(r, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"])


def sources(file_dir):
    """(name, source, policies that apply) for in-memory data and 1/3/8 files."""
    yield "memory", tf.data.Dataset.range(N), ("auto", "data")
    for n in FILE_COUNTS:
        yield f"{n} files", sorted(str(p) for p in file_dir.glob(f"ids-{n}-*")), \
            ("auto", "data", "file")


def epoch_ids(strategy, dataset):
    """Ids this process's replicas see in one epoch."""
    ids = []
    for batch in dataset:
        for replica_batch in strategy.experimental_local_results(batch):
            ids += np.asarray(replica_batch).ravel().tolist()
    return ids


def collect_ids(file_dir, tfds_dir=None):
    """Runs in each worker: ids seen per (source, policy), and the reported counts."""
    import pathlib

    import tf_distrib as td

    strategy = td.make_strategy()
    seen = {}
    for name, source, policies in sources(pathlib.Path(file_dir)):
        for policy in policies:
            dist = td.data.distribute_dataset(strategy, source, GLOBAL_BATCH,
                                              shard_policy=policy, reader=read_ids)
            seen[(name, policy)] = (epoch_ids(strategy, dist), dist.steps_per_epoch,
                                    dist.dropped_examples)
    # repeat=True: one iterator, and every steps_per_epoch steps are one whole epoch.
    for name, source, _ in list(sources(pathlib.Path(file_dir)))[:2]:
        dist = td.data.distribute_dataset(strategy, source, GLOBAL_BATCH, reader=read_ids,
                                          shuffle_buffer=N, repeat=True)
        for epoch, ids in enumerate(repeated_epochs(strategy, dist, 2)):
            seen[(f"{name}, repeated, epoch {epoch}", "auto")] = (
                ids, dist.steps_per_epoch, dist.dropped_examples)
    if tfds_dir:
        source = td.data.tfds_source("tf_distrib_blobs", "test", data_dir=tfds_dir,
                                     as_supervised=False)
        dist = td.data.distribute_dataset(strategy, source.__class__(
            source.name, source.split, source.data_dir, False), GLOBAL_BATCH)
        ids = []
        for batch in dist:
            for replica in strategy.experimental_local_results(batch["id"]):
                ids += np.asarray(replica).tolist()
        seen[("tfds", "auto")] = (ids, dist.steps_per_epoch, dist.dropped_examples)
    return seen


def repeated_epochs(strategy, dataset, epochs):
    """Ids this process's replicas see in each of `epochs` epochs of one iterator."""
    iterator = iter(dataset)
    out = []
    for _ in range(epochs):
        ids = []
        for _ in range(dataset.steps_per_epoch):
            for replica_batch in strategy.experimental_local_results(next(iterator)):
                ids += np.asarray(replica_batch).ravel().tolist()
        out.append(ids)
    return out


def assert_exactly_once(ids, steps, dropped, total=N, max_dropped=GLOBAL_BATCH):
    counts = collections.Counter(ids)
    assert max(counts.values()) == 1, "an id was seen twice"
    assert set(ids) <= set(range(total))
    assert len(ids) == steps * GLOBAL_BATCH
    assert dropped == total - len(ids) and dropped < max_dropped


@pytest.fixture(scope="module")
def file_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ids")
    for n in FILE_COUNTS:
        write_id_files(directory, n)
    return directory


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tfds"))
    import tf_distrib.datasets

    tf_distrib.datasets.prepare(directory)
    return directory


def test_preparing_the_tfds_dataset_leaves_nothing_in_the_temporary_directory(tmp_path,
                                                                            monkeypatch):
    import tempfile

    import tf_distrib.datasets

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    builder = tf_distrib.datasets.prepare(str(tmp_path / "tfds"))
    assert builder.info.splits["train"].num_examples == tf_distrib.datasets.NUM_EXAMPLES
    assert not list(scratch.iterdir())


def test_exactly_once_on_mirrored_four_replicas(file_dir):
    strategy = td.make_strategy()
    assert strategy.num_replicas_in_sync == LOGICAL_CPUS
    for (name, policy), (ids, steps, dropped) in collect_ids(file_dir).items():
        assert_exactly_once(ids, steps, dropped), (name, policy)


@pytest.mark.multiprocess
def test_exactly_once_across_two_workers(file_dir, tfds_dir):
    workers = run_workers(collect_ids, 2, args=(str(file_dir), tfds_dir), quiet=True,
                          timeout=240)
    a, b = (w.value for w in workers)
    assert a.keys() == b.keys()
    for key in a:
        (ids_a, steps, dropped), (ids_b, steps_b, dropped_b) = a[key], b[key]
        assert (steps, dropped) == (steps_b, dropped_b), key
        assert len(ids_a) == len(ids_b), f"{key}: workers ran different step counts"
        total = 1024 if key[0] == "tfds" else N
        # 3 files of 86, 724 and 190 records: whole files leave the workers at 724 and
        # 276, the smaller bounds the steps, and a warning says so.
        limit = N if key == ("3 files", "file") else GLOBAL_BATCH
        assert_exactly_once(ids_a + ids_b, steps, dropped, total, limit)
    assert a[("3 files", "file")][2] == N - 2 * (276 // 16) * 16
    # Repeated epochs are reshuffled.
    assert a[("memory, repeated, epoch 0", "auto")] != a[("memory, repeated, epoch 1", "auto")]
    output = "".join(workers[0].output)
    assert "Whole-file sharding of 3 files over 2 pipelines" in output
    assert "Whole-file sharding of 8 files" not in output


def test_identical_batches_whatever_the_layout(file_dir):
    """1 worker x 4 replicas and 2 workers x 1 replica consume the same global batches."""
    strategy = td.make_strategy()
    dist = td.data.distribute_dataset(strategy, tf.data.Dataset.range(N), GLOBAL_BATCH)
    local = [np.concatenate([np.asarray(t) for t in strategy.experimental_local_results(b)])
             for b in dist]
    expected = np.arange(len(local) * GLOBAL_BATCH).reshape(len(local), GLOBAL_BATCH)
    np.testing.assert_array_equal(np.stack(local), expected)


def test_shuffled_epochs_are_permutations_and_reproducible():
    strategy = td.make_strategy()

    def two_epochs(seed):
        dist = td.data.distribute_dataset(strategy, tf.data.Dataset.range(N), GLOBAL_BATCH,
                                          shuffle_buffer=N, seed=seed)
        return epoch_ids(strategy, dist), epoch_ids(strategy, dist)

    first, second = two_epochs(seed=7)
    assert first != second
    assert len(set(first)) == len(first) and len(set(second)) == len(second)
    assert two_epochs(seed=7) == (first, second)
    assert two_epochs(seed=8)[0] != first


def test_iterators_run_without_autotuning_threads():
    # Destroying an iterator waits for its autotuning thread (seconds in TF 2.21): Keras
    # fit drops one or two per epoch, so neither the pipelines nor TF's per-device
    # buffers behind them may run one. Reaches into TF's iterator: if TF changes its
    # layout, this fails, and the fix in tf_distrib/_input_stalls.py needs a look.
    strategy = td.make_strategy()
    for autotune in (False, True):
        dataset = td.data.distribute_dataset(strategy, tf.data.Dataset.range(N), GLOBAL_BATCH,
                                             autotune=autotune)
        iterator = iter(dataset)
        next(iterator)
        for worker in iterator._iterators:
            assert (worker._dataset.options().autotune.enabled is not False) == autotune
            buffers = worker._iterator._device_iterators
            assert len(buffers) == LOGICAL_CPUS
            assert all(b._dataset.options().autotune.enabled is False for b in buffers)


def test_per_replica_batch_size():
    strategy = td.make_strategy()
    assert td.data.per_replica_batch_size(strategy, 64) == 16
    with pytest.raises(ValueError, match="does not divide by the 4 replicas.*e.g. 60 or 64"):
        td.data.per_replica_batch_size(strategy, 62)
    with pytest.raises(ValueError, match="global_batch_size must be an integer >= 1"):
        td.data.per_replica_batch_size(strategy, 0)


def test_shard_files_never_leaves_a_pipeline_empty(file_dir):
    files = sorted(str(p) for p in file_dir.glob("ids-3-*"))

    def pipeline(i, n, **kwargs):
        context = tf.distribute.InputContext(num_input_pipelines=n, input_pipeline_id=i)
        return [int(x) for x in td.data.shard_files(files, context, read_ids, **kwargs)]

    whole_files = [pipeline(i, 2) for i in range(2)]
    assert sorted(whole_files[0] + whole_files[1]) == list(range(N))
    with pytest.warns(UserWarning, match="3 file.* for 5 input pipelines: sharding by record"):
        by_record = [pipeline(i, 5) for i in range(5)]
    assert all(by_record) and sorted(sum(by_record, [])) == list(range(N))
    with pytest.raises(ValueError, match="every pipeline needs a whole file"):
        pipeline(0, 5, allow_record_sharding=False)


def test_drop_remainder_false_with_one_replica():
    strategy = tf.distribute.get_strategy()
    dist = td.data.distribute_dataset(strategy, tf.data.Dataset.range(10), 4,
                                      drop_remainder=False)
    assert [len(b) for b in dist] == [4, 4, 2]


@pytest.mark.parametrize("make_call, error, message", [
    (lambda s, f: td.data.distribute_dataset(s, tf.data.Dataset.range(8), 6),
     ValueError, "does not divide by the 4 replicas"),
    (lambda s, f: td.data.distribute_dataset(s, [], 8), ValueError, "list of files is empty"),
    (lambda s, f: td.data.distribute_dataset(s, str(f / "nothing-*.tfrecord"), 8),
     ValueError, "No file matches"),
    (lambda s, f: td.data.distribute_dataset(s, [str(f / "missing.tfrecord")], 8),
     ValueError, "do not exist"),
    (lambda s, f: td.data.distribute_dataset(s, lambda ctx: [1, 2, 3], 8),
     TypeError, "returned list; it must return an unbatched tf.data.Dataset"),
    (lambda s, f: td.data.distribute_dataset(s, tf.data.Dataset.range(8), 8,
                                             shard_policy="by_file"),
     ValueError, "shard_policy must be one of"),
    (lambda s, f: td.data.distribute_dataset(s, tf.data.Dataset.range(8), 8,
                                             shard_policy="file"),
     ValueError, "'file' needs files"),
    (lambda s, f: td.data.distribute_dataset(s, lambda ctx: tf.data.Dataset.range(8), 8,
                                             shard_policy="data"),
     ValueError, "does not apply to a dataset function"),
    (lambda s, f: td.data.distribute_dataset(s, tf.data.Dataset.range(8), 8,
                                             drop_remainder=False),
     ValueError, "drop_remainder=False needs a single replica"),
    (lambda s, f: td.data.distribute_dataset(s, np.arange(8), 8),
     TypeError, "source must be"),
    (lambda s, f: td.data.distribute_dataset(s, lambda ctx: tf.data.Dataset.range(8), 8,
                                             repeat=True),
     ValueError, "repeat=True needs an epoch length"),
])
def test_bad_input(file_dir, make_call, error, message):
    with pytest.raises(error, match=message):
        make_call(td.make_strategy(), file_dir)
