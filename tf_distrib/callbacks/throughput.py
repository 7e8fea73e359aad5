"""Throughput: examples/sec across all replicas and step-time percentiles, in `logs`."""

from __future__ import annotations

import time

import keras
import numpy as np

from tf_distrib._checks import check_int


class Throughput(keras.callbacks.Callback):
    """Adds throughput and step times to each epoch's `logs`.

    At the end of every epoch `logs` gains `examples_per_sec` (global, all replicas)
    and `examples_per_sec_per_replica`, measured over the epoch's training wall time
    (per-epoch costs such as building the distributed iterator included, validation
    excluded), and `step_time`, `step_time_p50`, `step_time_p95` (seconds per step,
    each step on its own). The progress bar, `History`, `CSVLogger` and
    `keras.callbacks.TensorBoard` then show them; put `Throughput` before those in
    the callback list. The first `warmup_steps` steps of the first epoch are left
    out: they trace and compile the step function (`warmup_excluded` says how many
    were).

    Args:
        global_batch_size: Examples per step across all replicas.
        warmup_steps: Steps of the first epoch left out of the numbers. Defaults to 2.

    Example:

    ```python
    model.fit(dataset, epochs=3, callbacks=[td.callbacks.Throughput(256)])
    print(history.history["examples_per_sec"])
    ```
    """

    def __init__(self, global_batch_size: int, warmup_steps: int = 2):
        super().__init__()
        check_int("global_batch_size", global_batch_size)
        check_int("warmup_steps", warmup_steps, minimum=0)
        self.global_batch_size = global_batch_size
        self.warmup_steps = warmup_steps
        self.warmup_excluded = 0

    def on_train_begin(self, logs=None):
        self._to_skip = self.warmup_steps
        self.warmup_excluded = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._durations: list[float] = []
        self._start = time.perf_counter()
        self._end = None

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        end = time.perf_counter()
        if self._to_skip:
            self._to_skip -= 1
            self.warmup_excluded += 1
            self._start = end
            return
        self._durations.append(end - self._begin)

    def on_test_begin(self, logs=None):
        # Validation runs inside the epoch; it is not training throughput.
        if self._end is None:
            self._end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._durations:
            return
        steps_per_call = self.model.steps_per_execution
        elapsed = (self._end or time.perf_counter()) - self._start
        examples = len(self._durations) * steps_per_call * self.global_batch_size
        per_step = np.asarray(self._durations) / steps_per_call
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        logs["examples_per_sec"] = examples / elapsed
        logs["examples_per_sec_per_replica"] = examples / elapsed / replicas
        logs["step_time"] = float(per_step.mean())
        logs["step_time_p50"] = float(np.percentile(per_step, 50))
        logs["step_time_p95"] = float(np.percentile(per_step, 95))
