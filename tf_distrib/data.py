"""Dataset sharding: every example once per epoch across all replicas and workers.

Example:

```python
strategy = td.make_strategy()
ds = tf.data.Dataset.from_tensor_slices((x, y))          # unbatched
dist = td.data.distribute_dataset(strategy, ds, global_batch_size=256,
                                  shuffle_buffer=10_000, seed=1)
model.fit(dist, epochs=3, steps_per_epoch=td.data.steps_per_epoch(len(x), 256))
```
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

__all__ = ["distribute_dataset", "per_replica_batch_size", "steps_per_epoch"]

# Every input pipeline must shuffle in the same order when each one reads the whole
# dataset and keeps its slice; a seed shared by all workers guarantees that.
DEFAULT_SHARED_SEED = 0


def per_replica_batch_size(strategy: tf.distribute.Strategy, global_batch_size: int) -> int:
    """Returns the batch each replica computes on for `global_batch_size`.

    Args:
        strategy: The strategy that will run the steps.
        global_batch_size: Examples per step across all replicas and workers.

    Raises:
        ValueError: if `global_batch_size` is not a positive multiple of the replicas.
    """
    replicas = strategy.num_replicas_in_sync
    if (isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int)
            or global_batch_size < 1):
        raise ValueError(f"global_batch_size must be a positive integer, got "
                         f"{global_batch_size!r}.")
    if global_batch_size % replicas:
        lower = global_batch_size - global_batch_size % replicas
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide by the "
            f"{replicas} replicas in sync; use a multiple of {replicas}, e.g. "
            f"{lower or replicas} or {lower + replicas}.")
    return global_batch_size // replicas


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Steps of one epoch when the last partial global batch is dropped."""
    return num_examples // global_batch_size


def distribute_dataset(strategy: tf.distribute.Strategy,
                       source: tf.data.Dataset | Callable[[tf.distribute.InputContext],
                                                          tf.data.Dataset],
                       global_batch_size: int, *, shuffle_buffer: int | None = None,
                       seed: int | None = None,
                       prefetch: int = tf.data.AUTOTUNE) -> tf.distribute.DistributedDataset:
    """Shards, shuffles, batches and prefetches `source` for `strategy`.

    Each step consumes one global batch: `global_batch_size` consecutive examples of
    the (shuffled) dataset, split in order across the replicas of all workers. The
    result is the same whatever the layout: 2 workers x 1 replica and 1 worker x 2
    replicas compute on the same examples at every step. Every input pipeline yields
    the same number of steps (a partial last global batch is dropped), so
    MultiWorkerMirroredStrategy's collectives never mismatch.

    Args:
        strategy: The strategy whose replicas consume the data.
        source: An unbatched `tf.data.Dataset` (every worker reads it and keeps its
            own slice), or `fn(input_context) -> unbatched tf.data.Dataset` that
            returns only this input pipeline's examples.
        global_batch_size: Examples per step across all replicas.
        shuffle_buffer: Shuffle buffer size, or None not to shuffle. Defaults to None.
        seed: Shuffle seed. With a shared dataset and several input pipelines it
            must be the same on every worker. Defaults to None: `DEFAULT_SHARED_SEED`
            for a shared dataset read by several pipelines, random otherwise.
        prefetch: Batches to prefetch. Defaults to `tf.data.AUTOTUNE`.

    Returns:
        A `tf.distribute.DistributedDataset` for `model.fit`.
    """
    per_replica = per_replica_batch_size(strategy, global_batch_size)
    if not (callable(source) or isinstance(source, tf.data.Dataset)):
        raise TypeError(f"source must be an unbatched tf.data.Dataset or a function of an "
                        f"InputContext, got {type(source).__name__}.")

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        ds = source(context) if callable(source) else source
        if not isinstance(ds, tf.data.Dataset):
            raise TypeError(f"The dataset function returned {type(ds).__name__}; it must "
                            "return an unbatched tf.data.Dataset.")
        pipelines = context.num_input_pipelines
        shared = not callable(source) and pipelines > 1
        if shuffle_buffer:
            shuffle_seed = DEFAULT_SHARED_SEED if seed is None and shared else seed
            ds = ds.shuffle(shuffle_buffer, seed=shuffle_seed, reshuffle_each_iteration=True)
        if shared:
            local = strategy.num_replicas_in_sync // pipelines
            lo = context.input_pipeline_id * local * per_replica
            hi = lo + local * per_replica
            ds = ds.batch(global_batch_size, drop_remainder=True)
            steps = int(ds.cardinality())
            # Keep this pipeline's slice of each global batch, one element per replica.
            ds = ds.map(lambda *b: tf.nest.map_structure(
                lambda t: tf.reshape(t[lo:hi], [local, per_replica, *t.shape[1:]]),
                b if len(b) > 1 else b[0]))
            ds = ds.unbatch()
            if steps >= 0:
                ds = ds.apply(tf.data.experimental.assert_cardinality(steps * local))
        else:
            ds = ds.batch(per_replica, drop_remainder=True)
        return ds.prefetch(prefetch)

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    _count_steps_not_batches(dataset, _local_replicas(strategy))
    return dataset


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
    cardinality = getattr(dataset, "_cardinality", None)
    if cardinality is not None and cardinality >= 0 and local_replicas > 1:
        dataset._cardinality = cardinality // local_replicas
