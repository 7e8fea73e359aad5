"""Cost of a backup: tf_distrib's BackupAndRestore next to Keras 3's, in one run.

Each callback backs up after every step (save_freq=1) of a `fit`; the difference
from the same `fit` without a callback, per step, is the cost of one save. The
overhead at save_freq="epoch" is that cost over one epoch's time, for an epoch of
MNIST's size (60,000 examples, from the measured step time). Model: MLP
784-512-512-10 with Adam (2.0M floats of weights and slots, 8 MB).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

STEPS = 40
BATCH = 64
EPOCH_EXAMPLES = 60_000


def _fit_seconds(model, dataset, callbacks, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(options) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.bench.models import mlp

    repeats = 1 if options.quick else 5
    x = np.random.default_rng(0).random((STEPS * BATCH, 784), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, len(x)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache()
    model = mlp(optimizer=keras.optimizers.Adam(1e-3))
    model.fit(dataset, epochs=1, verbose=0)  # trace and build
    with tempfile.TemporaryDirectory() as tmp:
        candidates = {
            "keras.callbacks.BackupAndRestore": lambda: [keras.callbacks.BackupAndRestore(
                os.path.join(tmp, "keras"), save_freq=1, delete_checkpoint=True)],
            "tf_distrib BackupAndRestore": lambda: [td.callbacks.BackupAndRestore(
                os.path.join(tmp, "ours"), save_freq=1, delete_checkpoint=True)],
        }
        plain = _fit_seconds(model, dataset, list, repeats)
        epoch = plain / STEPS * EPOCH_EXAMPLES / BATCH
        results = {"epoch_seconds": epoch, "epoch_examples": EPOCH_EXAMPLES}
        for name, callbacks in candidates.items():
            per_save = (_fit_seconds(model, dataset, callbacks, repeats) - plain) / STEPS
            results[name] = {"ms_per_save": per_save * 1e3,
                             "epoch_overhead_percent": 100 * per_save / epoch}
    keras_ms = results["keras.callbacks.BackupAndRestore"]["ms_per_save"]
    print(f"step: {plain / STEPS * 1e3:.2f} ms (batch {BATCH}, median of {repeats}); epoch of "
          f"{EPOCH_EXAMPLES} examples: {epoch:.2f} s")
    print(f"{'callback':<36}{'ms/save':>10}{'vs keras':>10}{'% of epoch (save_freq=epoch)':>31}")
    for name in candidates:
        r = results[name]
        r["ratio_to_keras"] = r["ms_per_save"] / keras_ms
        print(f"{name:<36}{r['ms_per_save']:>10.1f}{r['ratio_to_keras']:>9.2f}x"
              f"{r['epoch_overhead_percent']:>30.2f}%")
    return results
