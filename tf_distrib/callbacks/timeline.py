"""Timeline: a Chrome trace of the last steps of every worker, written when `fit` ends."""

from __future__ import annotations

import os
import shutil
import time
import warnings

import keras

from tf_distrib import contract
from tf_distrib._checks import check_int
from tf_distrib.health import steps as steps_lib
from tf_distrib.health import timeline

# Seconds the chief waits for the other workers' parts when `fit` ends.
_PARTS_WAIT_SECONDS = 10.0


class Timeline(keras.callbacks.Callback):
    """Writes the last `steps` steps of every worker as a Chrome trace to `path`.

    Each step is a span with its input wait nested inside and its split in its
    arguments; every collective (one per gradient bucket, the logged values' too) and
    every backup span are on tracks of their own; one process per worker, clocks
    aligned on the collectives (`tf_distrib.health.timeline`). Every worker writes its
    part to `path.parts/`; the chief waits up to 10 s for the others' (they end `fit`
    at the same step) and merges them into `path`, which opens in Perfetto
    (ui.perfetto.dev) and chrome://tracing. Parts of workers on other hosts need a
    shared `path`; `tf-distrib launch --timeline FILE` merges them itself.

    Args:
        path: The trace file to write.
        steps: How many of the last steps it shows. Defaults to 200.

    Example:

    ```python
    model.fit(dataset, epochs=2, callbacks=[td.callbacks.Timeline("/tmp/trace.json")])
    ```
    """

    def __init__(self, path: str, steps: int = steps_lib.DEFAULT_STEPS):
        super().__init__()
        check_int("steps", steps)
        self.path, self.steps = path, steps

    def on_train_begin(self, logs=None):
        self._recorder = steps_lib.recorder_of(self.model.distribute_strategy, create=True,
                                           keep=self.steps)
        self._recorder.collecting = True

    def on_train_end(self, logs=None):
        parts = self.path + ".parts"
        workers = contract.num_workers() or getattr(
            getattr(self.model.distribute_strategy, "transport", None), "world", 1)
        timeline.write_part(self._recorder, timeline.part_path(parts, self._recorder.worker))
        if self._recorder.worker != 0:
            return
        paths = [timeline.part_path(parts, i) for i in range(workers)]
        deadline = time.monotonic() + _PARTS_WAIT_SECONDS
        while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
            time.sleep(0.05)
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            warnings.warn(f"Timeline: {len(missing)} worker(s) wrote no part into {parts} "
                          f"within {_PARTS_WAIT_SECONDS:g} s (another host without a shared "
                          "path?); the trace shows the others.", RuntimeWarning, stacklevel=2)
        timeline.merge(paths, self.path)
        if not missing:
            shutil.rmtree(parts, ignore_errors=True)
