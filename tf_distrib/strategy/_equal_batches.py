"""Whether every replica provably gets a batch at every step of a plain dataset.

Unless a dataset's batches have a static size, TensorFlow asks at every step whether
every replica still has data (`get_next_as_optional`), across workers one more
collective per step. When the dataset is one `batch(B)` over N in-memory examples, N
known and a multiple of B, with nothing above the batch that could change its size
(prefetch, options, cache), every global batch is full and the check can go. Whatever
this module does not recognise keeps TensorFlow's check.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib import _compat

# Steps above the batch that keep each batch as it is (TensorFlow's class names).
_KEEP_BATCHES = {"_PrefetchDataset", "_OptionsDataset", "CacheDataset"}
_BATCHES = {"_BatchDataset", "_ParallelBatchDataset"}
# Sources that read no files: automatic sharding cannot shard them by file.
_IN_MEMORY = {"_TensorSliceDataset", "_TensorDataset", "_RangeDataset"}
# Sharding policies under which such a source is sharded by data, or not at all.
_POLICIES = {tf.data.experimental.AutoShardPolicy.AUTO, tf.data.experimental.AutoShardPolicy.DATA,
             tf.data.experimental.AutoShardPolicy.OFF}


def every_replica_has_a_batch(dataset: tf.data.Dataset) -> bool:
    """Whether every global batch of `dataset` is full (see the module's docstring).

    Args:
        dataset: The dataset given to the strategy.

    Returns:
        True only where it is proved; False for anything else.
    """
    if dataset.options().experimental_distribute.auto_shard_policy not in _POLICIES:
        return False
    node = dataset
    while type(node).__name__ in _KEEP_BATCHES:
        node = _only_input(node)
    if type(node).__name__ not in _BATCHES:
        return False
    examples = _only_input(node)
    batch = _compat.dataset_batch_size(node)
    if examples is None or not batch or not _from_memory(examples):
        return False
    count = int(examples.cardinality())
    return count > 0 and count % batch == 0


def _from_memory(dataset) -> bool:
    """Whether `dataset` is a chain of one-input steps over an in-memory source."""
    for _ in range(1000):  # pipelines are short; anything longer keeps the check
        inputs = _compat.dataset_inputs(dataset)
        if inputs == []:
            return type(dataset).__name__ in _IN_MEMORY
        if inputs is None or len(inputs) != 1:  # zip, concatenate, ...
            return False
        [dataset] = inputs
    return False


def _only_input(dataset):
    """The one dataset `dataset` reads from; None if it reads from several, or none."""
    inputs = _compat.dataset_inputs(dataset)
    return inputs[0] if inputs is not None and len(inputs) == 1 else None
