"""WorkerMetrics: every worker's step time, its split and throughput, in TensorBoard per worker."""

from __future__ import annotations

import os

import keras
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from tf_distrib._checks import check_int
from tf_distrib.health import steps

_SCALAR = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
#: The scalars each worker writes, under "worker/" in its run.
SCALARS = ("step_time", "compute", "input_wait", "exchange", "peer_wait", "backup",
           "examples_per_sec", "bytes_exchanged")


class WorkerMetrics(keras.callbacks.Callback):
    """Writes this worker's step-time split and throughput to `log_dir/worker_<i>`.

    Every worker writes its own run, so TensorBoard overlays the workers: a straggler's
    `compute` or `input_wait` stands out, and its peers' `peer_wait` with it. The
    scalars (`SCALARS`; times in seconds per step, means over the steps since the last
    write) come from the strategy's step recorder (`tf_distrib.health.steps`), which
    measures steps of `fit` under `make_strategy()`'s strategies. Use it on every
    worker (not inside `ChiefOnly`).

    Args:
        log_dir: The TensorBoard log directory (local or any `tf.io.gfile` path).
        update_freq: "epoch", or write every this many steps. Defaults to "epoch".

    Example:

    ```python
    model.fit(dataset, epochs=3, callbacks=[td.callbacks.WorkerMetrics("/logs/run1")])
    # tensorboard --logdir /logs/run1   (runs worker_0, worker_1, ...)
    ```
    """

    def __init__(self, log_dir: str, update_freq: str | int = "epoch"):
        super().__init__()
        if update_freq != "epoch":
            check_int("update_freq", update_freq)
        self.log_dir, self.update_freq = log_dir, update_freq
        self._writer = None

    def on_train_begin(self, logs=None):
        self._recorder = steps.recorder_of(self.model.distribute_strategy, create=True)
        self._written = self._recorder.steps[-1].number + 1 if self._recorder.steps else 0
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.log_dir, f"worker_{self._recorder.worker}"))

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq != "epoch" and (batch + 1) % self.update_freq == 0:
            self._write()

    def on_epoch_end(self, epoch, logs=None):
        if self.update_freq == "epoch":
            self._write()

    def on_train_end(self, logs=None):
        self._writer.flush()

    def _write(self) -> None:
        new = [s for s in self._recorder.steps if s.number >= self._written]
        if not new:
            return
        self._written = new[-1].number + 1
        mean = lambda f: sum(f(s) for s in new) / len(new)  # noqa: E731
        elapsed = new[-1].ended - new[0].started
        values = {"step_time": mean(lambda s: s.duration), "compute": mean(lambda s: s.compute),
                  "input_wait": mean(lambda s: s.input_wait),
                  "exchange": mean(lambda s: s.exchange),
                  "peer_wait": mean(lambda s: s.peer_wait), "backup": mean(lambda s: s.backup),
                  "examples_per_sec": sum(s.examples for s in new) / elapsed if elapsed else 0.0,
                  "bytes_exchanged": float(self._recorder.bytes_exchanged)}
        with self._writer.as_default():
            for name in SCALARS:
                # tf.summary.scalar's own path needs the tensorboard package; this writes
                # the same event (a float32 scalar of the "scalars" plugin) without it.
                tf.summary.write(f"worker/{name}", tf.constant(values[name], tf.float32),
                                 step=self._written, metadata=_SCALAR)
        self._writer.flush()
