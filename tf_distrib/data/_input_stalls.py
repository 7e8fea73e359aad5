"""Keeps Keras `fit` from stalling each time it drops a distributed iterator (TF 2.21).

Destroying a tf.data iterator waits for the thread of its autotuning model, which
sleeps for an optimization period that doubles up to 60 s; measured with py-spy and
gdb, the training thread stood in `~MultiDeviceIterator` -> `~RootDataset::Iterator`
while the model threads sat in `Model::OptimizeLoop`. Keras `fit` drops one or two
distributed iterators per epoch, so 2-worker epochs of 1.4 s took 2.3-5.1 s. Pipelines
without autotuning have no such thread: the fix is to turn it off in the pipelines
tf_distrib builds and in the per-device buffers TF adds behind them.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib import _compat


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` with tf.data's autotuning model off.

    AUTOTUNE stages keep working without it: parallel ones use the default parallelism
    (one call per core), prefetch buffers grow while the consumer waits.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def install_device_buffer_fix() -> None:
    """Builds the per-device buffers of TF's distributed iterators without autotuning.

    TF's `MultiDeviceIterator` puts a fixed one-batch buffer on each device in a pipeline
    of default options, so each one runs an autotuning thread with nothing to tune,
    and each one stalls its iterator's destruction. Process-wide once called
    (`distribute_dataset` calls it); idempotent.
    """
    _compat.wrap_device_buffers(without_autotune)
