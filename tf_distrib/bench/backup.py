"""Cost of a backup: tf_distrib's BackupAndRestore (asynchronous and not) next to Keras 3's.

- Small state (MLP 784-512-512-10 with Adam, 8 MB): each callback backs up after every
  step; the extra time per step is the cost of one save.
- Large state (MLP 1024-6144-6144-10 with Adam, ~530 MB): 80 steps with a backup every
  20, in 7 rounds of (sync, none, async), each against its round's run without backups
  (median over rounds), with TensorFlow's threads on every core and with one core free.
  "Blocked" is the training thread's time in the callback per save; "fit overhead" the
  whole cost against `fit` without backups, background work included.

docs/performance.md has the current table and how to reproduce it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time

from tf_distrib.bench import run_in_fresh_process

STEPS = 40
BATCH = 64
EPOCH_EXAMPLES = 60_000
LARGE_STEPS, LARGE_SAVE_FREQ, LARGE_BATCH = 80, 20, 32


def _fit_seconds(model, dataset, callbacks, repeats, steps=None):
    from tf_distrib.callbacks import background_save, host_snapshot

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks(), steps_per_epoch=steps)
        times.append(time.perf_counter() - start)
        # What a callback left running after `fit` (deleting its backups, releasing its
        # host memory) must not slow the next run down.
        for thread in threading.enumerate():
            if thread.name in (background_save.THREAD_NAME, host_snapshot.RELEASE_THREAD_NAME):
                thread.join(60)
    return statistics.median(times)


def _data(steps, batch, features):
    import numpy as np
    import tensorflow as tf

    x = np.random.default_rng(0).random((steps * batch, features), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, len(x)).astype("int32")
    from tf_distrib.data._input_stalls import without_autotune

    # Without tf.data's autotuning: in TF 2.21 the iterator each `fit` drops blocks until
    # the autotuner's next wake-up, 10 ms x (2^k - 1) after the start (20.47 s measured).
    return without_autotune(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache())


def _small(tmp, repeats):
    import keras

    import tf_distrib as td
    from tf_distrib.bench.models import mlp

    dataset = _data(STEPS, BATCH, 784)
    model = mlp(optimizer=keras.optimizers.Adam(1e-3))
    model.fit(dataset, epochs=1, verbose=0)  # trace and build
    candidates = {
        "keras.callbacks.BackupAndRestore": lambda: [keras.callbacks.BackupAndRestore(
            os.path.join(tmp, "keras"), save_freq=1, delete_checkpoint=True)],
        "tf_distrib BackupAndRestore, sync": lambda: [td.callbacks.BackupAndRestore(
            os.path.join(tmp, "sync"), save_freq=1, async_save=False)],
        "tf_distrib BackupAndRestore, async": lambda: [td.callbacks.BackupAndRestore(
            os.path.join(tmp, "async"), save_freq=1)],
    }
    plain = _fit_seconds(model, dataset, list, repeats)
    epoch = plain / STEPS * EPOCH_EXAMPLES / BATCH
    results = {"step_ms": plain / STEPS * 1e3, "epoch_seconds": epoch}
    for name, callbacks in candidates.items():
        per_save = (_fit_seconds(model, dataset, callbacks, repeats) - plain) / STEPS
        results[name] = {"ms_per_save": per_save * 1e3,
                         "epoch_overhead_percent": 100 * per_save / epoch}
    return results


def _large(tmp, rounds):
    import keras
    import numpy as np

    from tf_distrib.bench.models import mlp

    dataset = _data(LARGE_STEPS, LARGE_BATCH, 1024)
    model = mlp((6144, 6144), optimizer=keras.optimizers.Adam(1e-4), inputs=1024)
    model.fit(dataset.take(2), epochs=1, verbose=0)  # trace and build
    state_mb = sum(np.prod(v.shape) * 4 for v in model.variables + model.optimizer.variables)
    made = {"sync": [], "async": []}

    def backups(name):
        if name == "none":
            return []
        made[name].append(_timed_backup(os.path.join(tmp, f"large-{name}"),
                                        save_freq=LARGE_SAVE_FREQ,
                                        async_save=name == "async"))
        return made[name][-1:]

    # Rounds of (sync, none, async): each setting with backups is compared to the run
    # without, right next to it, and the median over rounds is kept. The development VM
    # switches between two speeds (25% apart) every few seconds to minutes; comparing each
    # setting's fastest run instead put the three in different phases.
    seconds = {"sync": [], "none": [], "async": []}
    for _ in range(rounds):
        for name, runs in seconds.items():
            runs.append(_fit_seconds(model, dataset, lambda n=name: backups(n), 1))
    results = {"state_mb": float(state_mb) / 1e6,
               "fit_seconds_without_backups": statistics.median(seconds["none"]),
               "fit_seconds": seconds}
    for name in ("sync", "async"):
        blocked = [t for c in made[name] for t in c.blocked]
        overheads = [100 * (t / plain - 1)
                     for t, plain in zip(seconds[name], seconds["none"], strict=True)]
        results[name] = {"blocked_seconds_per_save": statistics.median(blocked),
                         "fit_overhead_percent": statistics.median(overheads),
                         "fit_overhead_percent_per_round": overheads}
    return results


def _timed_backup(*args, **kwargs):
    """A BackupAndRestore that records how long each save holds the training thread."""
    import tf_distrib as td

    class TimedBackup(td.callbacks.BackupAndRestore):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.blocked = []

        def _save(self):
            start = time.perf_counter()
            super()._save()
            self.blocked.append(time.perf_counter() - start)

    return TimedBackup(*args, **kwargs)


def run(options) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    repeats = 1 if options.quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        small = _small(tmp, repeats)
    rounds = 1 if options.quick else 7
    cores = os.cpu_count() or 1
    large = {"every core trains": run_in_fresh_process(__name__, rounds, cores)}
    if cores > 1:
        large["one core left free"] = run_in_fresh_process(__name__, rounds, cores - 1)
    keras_ms = small["keras.callbacks.BackupAndRestore"]["ms_per_save"]
    print(f"8 MB of state (MLP 784-512-512-10, Adam), a backup every step: step "
          f"{small['step_ms']:.2f} ms; epoch of {EPOCH_EXAMPLES} examples "
          f"{small['epoch_seconds']:.2f} s")
    print(f"  {'callback':<40}{'ms/save':>10}{'vs keras':>10}{'% of epoch':>12}")
    for name, r in small.items():
        if isinstance(r, dict):
            r["ratio_to_keras"] = r["ms_per_save"] / keras_ms
            print(f"  {name:<40}{r['ms_per_save']:>10.1f}{r['ratio_to_keras']:>9.2f}x"
                  f"{r['epoch_overhead_percent']:>11.2f}%")
    for layout, result in large.items():
        sync = result["sync"]["blocked_seconds_per_save"]
        print(f"{result['state_mb']:.0f} MB of state (MLP 1024-6144-6144-10, Adam), "
              f"{LARGE_STEPS} steps, a backup every {LARGE_SAVE_FREQ}, {layout} "
              f"({result['threads']} threads): fit {result['fit_seconds_without_backups']:.1f} s "
              "without backups")
        print(f"  {'BackupAndRestore':<40}{'s blocked/save':>16}{'vs sync':>9}"
              f"{'fit overhead':>14}")
        for name in ("sync", "async"):
            r = result[name]
            r["ratio_to_sync"] = r["blocked_seconds_per_save"] / sync
            print(f"  {name:<40}{r['blocked_seconds_per_save']:>16.3f}"
                  f"{r['ratio_to_sync']:>8.2f}x{r['fit_overhead_percent']:>13.1f}%")
    return {"small": small, "large": large}


if __name__ == "__main__":
    import tensorflow as tf

    rounds, threads = int(sys.argv[1]), int(sys.argv[2])
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    with tempfile.TemporaryDirectory() as directory:
        print(json.dumps({**_large(directory, rounds), "threads": threads}))
