"""`distribute_dataset`: every example once per epoch across all replicas and workers."""

from __future__ import annotations

import dataclasses
import glob as glob_lib
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_distrib import _compat
from tf_distrib._checks import check_int
from tf_distrib.data import _input_stalls

__all__ = ["distribute_dataset", "per_replica_batch_size", "shard_files",
           "tfds_source", "TFDSSource", "SHARD_POLICIES", "set_epoch"]

SHARD_POLICIES = ("auto", "file", "data", "off")

# Every input pipeline must shuffle in the same order when each one reads the whole
# dataset and keeps its share; a seed shared by all workers guarantees that.
DEFAULT_SHARED_SEED = 0
# The graph seed of the function that shuffles one epoch (any constant but 0).
_EPOCH_GRAPH_SEED = 1

_log = logging.getLogger("tf_distrib")


def per_replica_batch_size(strategy: tf.distribute.Strategy, global_batch_size: int) -> int:
    """Returns the batch each replica computes on for `global_batch_size`.

    Args:
        strategy: The strategy that will run the steps.
        global_batch_size: Examples per step across all replicas and workers.

    Raises:
        ValueError: if `global_batch_size` is not a positive multiple of the replicas.
    """
    replicas = strategy.num_replicas_in_sync
    check_int("global_batch_size", global_batch_size)
    if global_batch_size % replicas:
        lower = global_batch_size - global_batch_size % replicas
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide by the "
            f"{replicas} replicas in sync; use a multiple of {replicas}, e.g. "
            f"{lower or replicas} or {lower + replicas}.")
    return global_batch_size // replicas


def shard_files(files: str | Sequence[str], input_context: tf.distribute.InputContext,
                reader: Callable[[str], tf.data.Dataset] = tf.data.TFRecordDataset, *,
                allow_record_sharding: bool = True) -> tf.data.Dataset:
    """This input pipeline's records: whole files when there are enough, records otherwise.

    Files are sorted and dealt round-robin: pipeline p reads files p, p + P, ...
    With fewer files than pipelines, every pipeline reads every file and keeps
    records p, p + P, ... (one warning), so no pipeline is ever empty.

    Args:
        files: File paths, or a glob pattern.
        input_context: The `tf.distribute.InputContext` of this pipeline.
        reader: Function from one file path to a dataset of its records.
            Defaults to `tf.data.TFRecordDataset`.
        allow_record_sharding: Fall back to record-level sharding when there are
            fewer files than pipelines; False raises instead. Defaults to True.

    Returns:
        An unbatched `tf.data.Dataset`.

    Example:

    ```python
    def dataset_fn(context):
        return td.data.shard_files("data/train-*.tfrecord", context).map(parse)

    dist = td.data.distribute_dataset(strategy, dataset_fn, global_batch_size=256)
    ```
    """
    files = _resolve_files(files)
    pipelines, index = input_context.num_input_pipelines, input_context.input_pipeline_id
    if len(files) >= pipelines:
        return _read(files[index::pipelines], reader)
    if not allow_record_sharding:
        raise ValueError(f"{len(files)} file(s) for {pipelines} input pipelines: every "
                         "pipeline needs a whole file. Split the data into at least "
                         f"{pipelines} files, or allow record-level sharding.")
    warnings.warn(f"{len(files)} file(s) for {pipelines} input pipelines: sharding by "
                  "record (every worker reads every file and keeps its share).", stacklevel=2)
    return _read(files, reader).shard(pipelines, index)


@dataclasses.dataclass(frozen=True)
class TFDSSource:
    """A TFDS split read offline, split evenly between input pipelines.

    Create it with `tfds_source`.

    Example:

    ```python
    source = td.data.tfds_source("mnist")   # a TFDSSource
    print(source.num_examples)
    ```
    """

    name: str
    split: str
    data_dir: str | None
    as_supervised: bool

    def num_examples(self) -> int:
        """Examples in the split, from the prepared dataset's metadata."""
        import tensorflow_datasets as tfds

        builder = tfds.builder(self.name, data_dir=self.data_dir)
        return builder.info.splits[self.split].num_examples

    def load(self, pipelines: int, index: int) -> tf.data.Dataset:
        """This pipeline's part: `tfds.even_splits` of the split, read without network."""
        import tensorflow_datasets as tfds

        split = tfds.even_splits(self.split, n=pipelines)[index] if pipelines > 1 else self.split
        return tfds.load(self.name, split=split, data_dir=self.data_dir, download=False,
                         as_supervised=self.as_supervised, shuffle_files=False)


def tfds_source(name: str, split: str = "train", *, data_dir: str | None = None,
                as_supervised: bool = True) -> TFDSSource:
    """A TFDS split as a source for `distribute_dataset`: disjoint, equal parts per worker.

    The split is divided with `tfds.even_splits` (so it works whatever the number of
    files), and nothing is downloaded: the dataset must already be prepared in
    `data_dir` (e.g. with `tf_distrib.datasets.prepare`).

    Args:
        name: The registered TFDS name, e.g. "tf_distrib_blobs".
        split: The split. Defaults to "train".
        data_dir: TFDS data directory. Defaults to None (TFDS' default).
        as_supervised: Yield (features, label) pairs. Defaults to True.

    Example:

    ```python
    source = td.data.tfds_source("mnist", split="train", data_dir="/data/tfds")
    dist = td.data.distribute_dataset(strategy, source, global_batch_size=256)
    ```
    """
    return TFDSSource(name, split, data_dir, as_supervised)


def distribute_dataset(strategy: tf.distribute.Strategy,
                       source: tf.data.Dataset | Callable | str | Sequence[str] | TFDSSource,
                       global_batch_size: int, *, shard_policy: str = "auto",
                       shuffle_buffer: int | None = None, seed: int | None = None,
                       drop_remainder: bool = True,
                       reader: Callable[[str], tf.data.Dataset] = tf.data.TFRecordDataset,
                       prefetch: int = tf.data.AUTOTUNE, repeat: bool = False,
                       autotune: bool = False) -> tf.distribute.DistributedDataset:
    """Shards, shuffles, batches and prefetches `source` for `strategy`'s `model.fit`.

    Every pipeline yields the same number of steps: sources whose size can be known
    (in-memory datasets, file lists, TFDS) are cut to the steps that every pipeline
    can fill, so MultiWorkerMirroredStrategy's collectives never mismatch. Examples
    left over are dropped and reported in the result's `dropped_examples`
    (`steps_per_epoch` holds the step count; both None when unknown).

    Shard policies:

    - "data": every pipeline reads the whole source (in the same shuffled order) and
      keeps every P-th example of it (P pipelines); global batch b is examples
      bG .. bG+G-1 of that order on every layout (2 workers x 1 replica, 1 worker x 2
      replicas, or another number of workers after an elastic restart).
    - "file" (file lists only): whole files per pipeline, dealt by record count so
      pipelines are as equal as whole files allow (a warning says how much is
      dropped otherwise); record sharding when there are fewer files than pipelines.
    - "off": no sharding; every pipeline reads the whole source (duplicates across
      workers). Function sources are always "off": they shard themselves.
    - "auto": "file" for file lists whose whole files give every pipeline the same
      steps (within one global batch), "data" for other file lists and datasets,
      even splits for TFDS, "off" for functions.

    Args:
        strategy: The strategy whose replicas consume the data.
        source: An unbatched `tf.data.Dataset`; a function
            `fn(input_context) -> unbatched tf.data.Dataset` returning this pipeline's
            examples; file paths or a glob (read with `reader`); or a `tfds_source`.
        global_batch_size: Examples per step across all replicas.
        shard_policy: One of `SHARD_POLICIES`. Defaults to "auto".
        shuffle_buffer: Shuffle buffer size, or None not to shuffle. Defaults to None.
        seed: Shuffle seed. With "data" sharding it must be the same on every worker.
            Epoch e's order derives from (seed, e), so a resumed epoch (`set_epoch`,
            which `BackupAndRestore` calls) reads its examples in the same order.
            Defaults to None: `DEFAULT_SHARED_SEED` where pipelines must agree, else
            drawn from numpy's global generator (`keras.utils.set_random_seed` fixes
            it).
        drop_remainder: Drop the last partial global batch. False is allowed only with
            one replica: a partial batch can be neither split evenly between replicas
            nor agreed on by workers. Defaults to True.
        reader: For file sources, a function from one path to a dataset of its records.
            Defaults to `tf.data.TFRecordDataset`.
        prefetch: Batches to prefetch. Defaults to `tf.data.AUTOTUNE`.
        repeat: Repeat the epoch without end, for
            `model.fit(dist, steps_per_epoch=dist.steps_per_epoch, epochs=...)`: every
            `steps_per_epoch` steps are one epoch, each example once (reshuffled when
            shuffling). Keras then keeps one iterator for the whole `fit` instead of
            building up to two per epoch (~0.2 s each under MWMS; docs/data.md). Needs
            a source whose size can be known. Defaults to False.
        autotune: Run tf.data's autotuning model on the pipelines. In TF 2.21 each
            iterator Keras `fit` drops then blocks training for up to the model's
            optimization period (docs/data.md). Without it, AUTOTUNE stages use one
            parallel call per core. Defaults to False.

    Returns:
        A `tf.distribute.DistributedDataset` for `model.fit`, with the attributes
        `steps_per_epoch` and `dropped_examples`.

    Raises:
        ValueError: for an unknown policy, a policy that does not fit the source, a
            batch that does not divide, no files, or drop_remainder=False with
            several replicas.
        TypeError: for a source of no known kind, or a function that returns no dataset.
    """
    per_replica = per_replica_batch_size(strategy, global_batch_size)
    if shard_policy not in SHARD_POLICIES:
        raise ValueError(f"shard_policy must be one of {SHARD_POLICIES}, got {shard_policy!r}.")
    if not drop_remainder and strategy.num_replicas_in_sync > 1:
        raise ValueError(
            f"drop_remainder=False needs a single replica; with "
            f"{strategy.num_replicas_in_sync} the last partial global batch can be neither "
            "split evenly between replicas nor agreed on by all workers. Keep "
            "drop_remainder=True: the dataset reports its dropped_examples.")
    local = _local_replicas(strategy)
    pipelines = strategy.num_replicas_in_sync // local
    plan = _plan(source, shard_policy, pipelines, local * per_replica, global_batch_size,
                 reader)
    if not drop_remainder:
        # One replica: nothing to equalize, and the partial last batch is kept.
        plan = dataclasses.replace(plan, steps=None, dropped=0)
    if repeat and plan.steps is None:
        raise ValueError(
            "repeat=True needs an epoch length that every pipeline shares, and this source's "
            "is unknown (a function source, a dataset of unknown or infinite size, or "
            "drop_remainder=False). Repeat inside your "
            "dataset instead and pass steps_per_epoch to fit yourself.")

    if shuffle_buffer:
        shared_order = plan.policy == "data" and pipelines > 1
        if seed is None:
            # Drawn from numpy's generator, so that keras.utils.set_random_seed makes it
            # the same in a restarted process: a resumed epoch gets its order back.
            seed = DEFAULT_SHARED_SEED if shared_order else int(np.random.randint(2**31))
        order = _EpochOrder(seed)

    def one_epoch(ds, context, epoch=None) -> tf.data.Dataset:
        if epoch is not None:
            # Traced inside flat_map: the order is (seed, epoch)'s alone, whatever the
            # global seed (TF's get_seed cannot compare a global seed of 0 to a tensor).
            tf.random.set_seed(_EPOCH_GRAPH_SEED)
            ds = ds.shuffle(shuffle_buffer, seed=order.seed(epoch),
                            reshuffle_each_iteration=False)
        if plan.policy == "data" and pipelines > 1:
            # Example i of each global batch goes to pipeline i % P: global batch b is
            # examples bG .. bG+G-1 on every layout, and each pipeline batches only its own
            # examples (batching all of them cost ~1 ms per step on 2 workers).
            ds = ds.shard(pipelines, context.input_pipeline_id)
        ds = ds.batch(per_replica, drop_remainder=drop_remainder)
        if plan.steps is not None:
            ds = ds.take(plan.steps * local)
            ds = ds.apply(tf.data.experimental.assert_cardinality(plan.steps * local))
        return ds

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        source = plan.read(context)
        if not isinstance(source, tf.data.Dataset):
            raise TypeError(f"The dataset function returned {type(source).__name__}; it must "
                            "return an unbatched tf.data.Dataset.")
        if shuffle_buffer:
            ds = order.epochs(repeat).flat_map(lambda epoch: one_epoch(source, context, epoch))
            if plan.steps is not None:
                ds = ds.apply(tf.data.experimental.assert_cardinality(
                    tf.data.INFINITE_CARDINALITY if repeat else plan.steps * local))
        else:
            ds = one_epoch(source, context)
            if repeat:
                ds = ds.repeat()
        ds = ds.prefetch(prefetch)
        return ds if autotune else _input_stalls.without_autotune(ds)

    _input_stalls.install_device_buffer_fix()
    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    _count_steps_not_batches(dataset, local)
    if plan.steps is not None and pipelines > 1:
        # Every pipeline yields exactly plan.steps batches (asserted above), so TF's
        # per-step all-reduce of "does every worker still have data?" (~1 ms of CPU per
        # step on TF's RPC) can only ever say yes. A pipeline that broke that promise
        # would fail its assertion, and its peers would learn it from their transport
        # or their hang watchdog.
        _compat.skip_partial_batch_checks(dataset)
    dataset.steps_per_epoch = plan.steps
    if plan.steps is None:
        # The default strategy returns a plain tf.data.Dataset (cardinality a method).
        cardinality = dataset.cardinality
        cardinality = int(cardinality() if callable(cardinality) else cardinality)
        dataset.steps_per_epoch = cardinality if cardinality >= 0 else None
    dataset.dropped_examples = plan.dropped
    if plan.dropped:
        _log.info("distribute_dataset: %d steps per epoch; %d example(s) dropped each epoch "
                  "(they do not fill a global batch of %d on every pipeline).",
                  plan.steps, plan.dropped, global_batch_size)
    return dataset


def set_epoch(epoch: int) -> None:
    """Tells every shuffling `distribute_dataset` of this process the epoch that starts.

    An epoch's shuffle order is a function of the seed and the epoch's number, and an
    iterator made now starts at `epoch` (with `repeat=True`, repetition k is epoch
    `epoch` + k). `callbacks.BackupAndRestore` calls it at the start of every epoch, so
    a resumed epoch reads its examples in the order the interrupted one did. Without
    it, each new iterator takes the next epoch's order (as tf.data's reshuffling does).

    Args:
        epoch: The epoch that starts, >= 0.

    Example:

    ```python
    td.data.set_epoch(3)   # the next epoch reads epoch 3's order (BackupAndRestore does this)
    ```
    """
    check_int("epoch", epoch, minimum=0)
    for order in list(_EpochOrder.live):
        order.start = epoch


class _EpochOrder:
    """Numbers the epochs of one shuffling dataset: their orders derive from their numbers.

    TensorFlow's `reshuffle_each_iteration` draws each order from how many iterators
    the process made before, which a restarted process cannot reproduce (Keras makes
    an extra iterator at the start of `fit`, prefetching reads ahead into the next
    repetition). Here a new iterator starts at `start`, when set (`set_epoch`), or else
    at the number of iterators made so far (read in Python, once per iterator).
    """

    live: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, seed: int):
        self._seed = seed
        self.start: int | None = None
        self._made = 0
        _EpochOrder.live.add(self)

    def _first_epoch(self) -> int:
        """The number of the first epoch of an iterator being made."""
        first = self._made if self.start is None else self.start
        self._made += 1
        return first

    def epochs(self, repeat: bool) -> tf.data.Dataset:
        """One element per epoch of an iterator, its number; endless with `repeat`."""
        first = tf.data.Dataset.from_tensors(0).map(
            lambda _: tf.reshape(tf.py_function(self._first_epoch, [], tf.int64), []))
        return first.flat_map(lambda e: tf.data.Dataset.range(e, e + (2**62 if repeat else 1)))

    def seed(self, epoch: tf.Tensor) -> tf.Tensor:
        # A prime stride keeps the (seed, epoch) -> order map one-to-one in practice.
        return tf.constant(self._seed, tf.int64) * 1_000_003 + epoch


@dataclasses.dataclass
class _Plan:
    policy: str
    read: Callable[[tf.distribute.InputContext], tf.data.Dataset]
    steps: int | None = None
    dropped: int | None = None


def _plan(source, policy, pipelines, pipeline_batch, global_batch, reader) -> _Plan:
    """How each pipeline reads `source`, and the step count all of them can fill."""
    if isinstance(source, TFDSSource):
        if policy not in ("auto", "data"):
            raise ValueError(f"shard_policy={policy!r} does not apply to a TFDS source, "
                             "which is split evenly between pipelines; use 'auto'.")
        total = source.num_examples()
        per_pipeline = total // pipelines  # even_splits gives floor or ceil of this
        steps = per_pipeline // pipeline_batch
        return _Plan("even", lambda c: source.load(c.num_input_pipelines, c.input_pipeline_id),
                     steps, total - steps * global_batch)
    if isinstance(source, tf.data.Dataset):
        if policy == "file":
            raise ValueError("shard_policy='file' needs files: pass the file paths (or a "
                             "glob) as source, or use 'data' for an in-memory dataset.")
        policy = "data" if policy == "auto" else policy
        total = int(source.cardinality())
        if total < 0:
            return _Plan(policy, lambda c: source)
        per_pipeline = total if policy == "off" else total // pipelines
        steps = per_pipeline // pipeline_batch
        dropped = (total - steps * global_batch) if policy == "data" else None
        return _Plan(policy, lambda c: source, steps, dropped)
    if isinstance(source, (str, list, tuple)):
        files = _resolve_files(source)
        return _file_plan(files, policy, pipelines, pipeline_batch, global_batch, reader)
    if callable(source):
        if policy not in ("auto", "off"):
            raise ValueError(f"shard_policy={policy!r} does not apply to a dataset function: "
                             "it returns its own pipeline's examples (e.g. with shard_files). "
                             "Use 'auto' or 'off'.")
        return _Plan("off", source)
    raise TypeError(f"source must be an unbatched tf.data.Dataset, a function of an "
                    f"InputContext, file paths or a tfds_source; got {type(source).__name__}.")


def _file_plan(files, policy, pipelines, pipeline_batch, global_batch, reader) -> _Plan:
    counts = [_count_records(f, reader) for f in files]
    total = sum(counts)
    if policy in ("auto", "file") and len(files) >= pipelines:
        groups = _balance(counts, pipelines)
        steps = min(sum(counts[i] for i in g) for g in groups) // pipeline_batch
        dropped = total - steps * global_batch
        # "auto" takes whole files only when they lose no more than a global batch.
        policy = "file" if policy == "file" or dropped < global_batch else "data"
    if policy == "file" and len(files) >= pipelines:
        if dropped >= global_batch:
            warnings.warn(
                f"Whole-file sharding of {len(files)} files over {pipelines} pipelines leaves "
                f"them unequal: {dropped} of {total} examples ({100 * dropped / total:.0f}%) "
                "are dropped each epoch so that every worker runs the same steps. Use more, "
                "equal files, or shard_policy='data'.", stacklevel=4)
        return _Plan("file", lambda c: _read([files[i] for i in groups[c.input_pipeline_id]],
                                             reader), steps, dropped)
    if policy == "file":
        steps = total // pipelines // pipeline_batch
        return _Plan("file", lambda c: shard_files(files, c, reader), steps,
                     total - steps * global_batch)
    policy = "data" if policy == "auto" else policy
    read_all = lambda c: _read(files, reader)  # noqa: E731
    if policy == "data":
        steps = total // pipelines // pipeline_batch
        return _Plan("data", read_all, steps, total - steps * global_batch)
    return _Plan("off", read_all, total // pipeline_batch, None)


def _balance(counts: list[int], pipelines: int) -> list[list[int]]:
    """Deals files, largest first, to the pipeline with the fewest records so far."""
    groups = [[] for _ in range(pipelines)]
    sizes = [0] * pipelines
    for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        target = sizes.index(min(sizes))
        groups[target].append(i)
        sizes[target] += counts[i]
    return [sorted(g) for g in groups]


def _resolve_files(files) -> list[str]:
    if isinstance(files, str):
        matched = sorted(glob_lib.glob(files)) if glob_lib.has_magic(files) else [files]
        if not matched:
            raise ValueError(f"No file matches {files!r}.")
        files = matched
    files = sorted(str(f) for f in files)
    if not files:
        raise ValueError("The list of files is empty; give at least one file.")
    missing = [f for f in files if not tf.io.gfile.exists(f)]
    if missing:
        raise ValueError(f"{len(missing)} file(s) do not exist, e.g. {missing[0]!r}.")
    return files


def _read(files, reader) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(files).flat_map(reader)


def _count_records(path, reader) -> int:
    return int(reader(path).reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def _local_replicas(strategy: tf.distribute.Strategy) -> int:
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has no device list: one replica
        return 1


def _count_steps_not_batches(dataset, local_replicas: int) -> None:
    """Makes `dataset.cardinality` the number of steps, as Keras `fit` reads it.

    TensorFlow's DistributedDatasetsFromFunction reports the cardinality of the
    per-pipeline dataset, which counts per-replica batches: with 4 local replicas,
    Keras would plan 4x the steps and warn "Your input ran out of data" every epoch.
    """
    cardinality = _compat.distributed_cardinality(dataset)
    if cardinality is not None and cardinality >= 0 and local_replicas > 1:
        _compat.set_distributed_cardinality(dataset, cardinality // local_replicas)
