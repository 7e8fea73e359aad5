"""Throughput: examples/sec, step-time percentiles and stragglers, in `logs`."""

from __future__ import annotations

import logging
import time

import keras
import numpy as np

from tf_distrib._checks import check_int

#: A worker is a straggler when its time outside collectives per step exceeds the
#: fastest worker's by more than this fraction and by at least STRAGGLER_MIN_SECONDS.
STRAGGLER_RATIO = 0.25
STRAGGLER_MIN_SECONDS = 0.005

_log = logging.getLogger("tf_distrib")


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

    Stragglers: under a MultiWorkerMirroredStrategy whose gradients go through
    tf_distrib's transport, each worker also measures its time outside collectives
    (input and compute) per step, and the workers share it at every epoch end: logs
    gain `busy_time` (this worker's seconds per step) and `busy_time/worker_<i>` for
    every worker, and the chief warns (logger "tf_distrib") about any worker whose
    time exceeds the fastest one's by more than `STRAGGLER_RATIO` (25%) and by at
    least 5 ms per step: that worker holds the others back. Use `Throughput` on every
    worker then (not inside `ChiefOnly`): sharing the times is a collective.

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
        self._in_collectives = self._collective_seconds()

    def _transport(self):
        return getattr(self.model.distribute_strategy, "transport", None)

    def _collective_seconds(self) -> float:
        transport = self._transport()
        return transport.stats.seconds if transport is not None else 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        end = time.perf_counter()
        if self._to_skip:
            self._to_skip -= 1
            self.warmup_excluded += 1
            self._start = end
            self._in_collectives = self._collective_seconds()
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
        if self._transport() is not None:
            busy = elapsed - (self._collective_seconds() - self._in_collectives)
            self._report_stragglers(logs, busy / (len(self._durations) * steps_per_call))

    def _report_stragglers(self, logs, busy: float) -> None:
        """Shares each worker's time outside collectives and names the stragglers."""
        from tf_distrib.transport import graph_op

        transport = self._transport()
        mine = np.zeros(transport.world, np.float64)
        mine[transport.rank] = busy
        [every] = graph_op.all_reduce(transport, [mine])
        every = every.numpy()
        logs["busy_time"] = busy
        for i, seconds in enumerate(every):
            logs[f"busy_time/worker_{i}"] = float(seconds)
        fastest = every.min()
        slow = [i for i, seconds in enumerate(every)
                if seconds > fastest * (1 + STRAGGLER_RATIO)
                and seconds - fastest >= STRAGGLER_MIN_SECONDS]
        if slow and transport.rank == 0:
            names = [str(transport.mesh.peers[i]) for i in slow]
            _log.warning(
                "tf_distrib: straggler(s) %s: %s ms per step outside collectives (input and "
                "compute), against %.1f ms for the fastest worker; the others wait for them "
                "every step.", ", ".join(names),
                ", ".join(f"{every[i] * 1e3:.1f}" for i in slow), fastest * 1e3)
