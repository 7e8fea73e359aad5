"""Recovery: from a worker's SIGKILL to the first step the restarted job finishes.

2 workers under `launch(max_restarts=1)` train the MLP 784-1024-1024-10 with Adam, 128
examples per worker per step, 4 epochs of 32 steps, `BackupAndRestore(dir)` at its
defaults (a backup at each epoch's end); worker 1 SIGKILLs itself once 60 steps are done.
Each row: seconds from the kill to the first step the restarted workers finish, and the
steps the restart trains again (60 minus the step it resumed from). Settings: the default
launch (workers forked from a preloaded process), fresh interpreters (`preload=False`),
and backups every step (`save_freq=1`); medians of `ROUNDS` rounds.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time

ROUNDS = 3
KILL_AFTER = 60
STEPS, EPOCHS = 32, 4
SETTINGS = {"default (preloaded workers)": (None, "epoch"),
            "fresh interpreters (preload=False)": (False, "epoch"),
            "default, a backup every step": (None, 1)}


def train(directory: str, save_freq) -> None:
    """One worker: trains, and on the first attempt worker 1 kills itself after step 60."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib import contract
    from tf_distrib.bench.models import mlp

    index, attempt = contract.worker_index(), contract.attempt()
    strategy = td.make_strategy()
    global_batch = 128 * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    x = rng.random((global_batch * STEPS, 784), dtype=np.float32)
    y = rng.integers(0, 10, len(x)).astype("int32")
    with strategy.scope():
        model = mlp((1024, 1024), optimizer=keras.optimizers.Adam(1e-3))
    data = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                      global_batch)
    backup = td.callbacks.BackupAndRestore(os.path.join(directory, "backup"), save_freq)

    class Marks(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.done = 0

        def on_train_batch_end(self, batch, logs=None):
            self.done += 1
            if attempt == 1 and self.done == 1:
                _write(directory, f"first-step-{index}", time.time())
                _write(directory, f"resumed-{index}", backup.restored_step or 0)
            if attempt == 0 and index == 1 and self.done == KILL_AFTER:
                _write(directory, "killed", time.time())
                os.kill(os.getpid(), signal.SIGKILL)

    model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[backup, Marks()])


def _write(directory: str, name: str, value: float) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(repr(value))


def _read(directory: str, name: str) -> float:
    with open(os.path.join(directory, name)) as f:
        return float(f.read())


def measure(preload: bool | None, save_freq) -> dict:
    """One launch of the scenario: seconds from the kill to the first step, steps lost."""
    from tf_distrib.launch import launch

    with tempfile.TemporaryDirectory(prefix="tf_distrib_bench_recovery_") as directory:
        result = launch(train, 2, args=(directory, save_freq), max_restarts=1, quiet=True,
                        timeout=600, preload=preload)
        if result.exit_code or result.restarts != 1:
            raise RuntimeError(f"the recovery job did not restart once and finish: "
                               f"{result.failure_report()}")
        first = max(_read(directory, f"first-step-{i}") for i in range(2))
        resumed = _read(directory, "resumed-0")
        return {"seconds": first - _read(directory, "killed"),
                "steps_lost": KILL_AFTER - resumed}


def run(options) -> dict:
    os.environ.pop("TF_DISTRIB_PRELOAD", None)  # the default launch decides by itself
    rounds = 1 if options.quick else ROUNDS
    measured = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, (preload, save_freq) in SETTINGS.items():
            measured[name].append(measure(preload, save_freq))
    report = {name: {"seconds": statistics.median(m["seconds"] for m in ms),
                     "steps_lost": statistics.median(m["steps_lost"] for m in ms),
                     "seconds_per_round": [m["seconds"] for m in ms]}
              for name, ms in measured.items()}
    print(f"{'SIGKILL of worker 1 after step 60, 2 workers, MLP + Adam':<58} "
          f"{'kill -> first step':>19} {'steps lost':>11}")
    for name, row in report.items():
        print(f"{name:<58} {row['seconds']:>17.2f} s {row['steps_lost']:>11.0f}   rounds "
              + ", ".join(f"{s:.2f}" for s in row["seconds_per_round"]))
    return report
