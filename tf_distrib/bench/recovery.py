"""Recovery: from a worker's SIGKILL to the first step the restarted job finishes.

2 workers under `launch(max_restarts=1)` train the MLP 784-1024-1024-10 with Adam, 128
examples per worker per step, 4 epochs of 32 steps, `BackupAndRestore(dir)` at its
defaults (a backup at each epoch's end, in-memory snapshots "auto"); worker 1 SIGKILLs
itself once 60 steps are done. Each row: seconds from the kill to the first step the
restarted workers finish, and the steps the restart trains again (60 minus the step it
resumed from). Settings: the defaults, snapshots off (`snapshot_freq=None`), fresh
interpreters (`preload=False`), backups every step instead of snapshots, and torchrun +
DDP (gloo, a `torch.save` at each epoch's end) where torch is installed; medians of
`ROUNDS` rounds. Then what snapshots cost (`snapshot_cost`), with SGD and with Adam.
"""

from __future__ import annotations

import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROUNDS = 3
KILL_AFTER = 60
STEPS, EPOCHS = 32, 4
# Row -> (preload, save_freq, snapshot_freq).
SETTINGS = {"defaults (preloaded workers, in-memory snapshots)": (None, "epoch", "auto"),
            "snapshots off (snapshot_freq=None)": (None, "epoch", None),
            "fresh interpreters (preload=False)": (False, "epoch", "auto"),
            "snapshots off, a backup every step (save_freq=1)": (None, 1, None)}
TORCHRUN = "torchrun + DDP (gloo), torch.save each epoch"


def mlp_job(optimizer: str):
    """(model, dataset) of the scenario's worker: the MLP with "sgd" or "adam", 128
    random examples per worker per step, `STEPS` steps an epoch."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.bench.models import mlp

    strategy = td.make_strategy()
    global_batch = 128 * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    x = rng.random((global_batch * STEPS, 784), dtype=np.float32)
    y = rng.integers(0, 10, len(x)).astype("int32")
    with strategy.scope():
        model = mlp((1024, 1024), optimizer={"sgd": keras.optimizers.SGD(0.01),
                                             "adam": keras.optimizers.Adam(1e-3)}[optimizer])
    return model, td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices((x, y)), global_batch)


def train(directory: str, save_freq, snapshot_freq="auto") -> None:
    """One worker: trains, and on the first attempt worker 1 kills itself after step 60."""
    import keras

    import tf_distrib as td
    from tf_distrib import contract

    index, attempt = contract.worker_index(), contract.attempt()
    model, data = mlp_job("adam")
    backup = td.callbacks.BackupAndRestore(os.path.join(directory, "backup"), save_freq,
                                           snapshot_freq=snapshot_freq)

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


def measure(preload: bool | None, save_freq, snapshot_freq="auto") -> dict:
    """One launch of the scenario: seconds from the kill to the first step, steps lost."""
    from tf_distrib.launch import launch

    with tempfile.TemporaryDirectory(prefix="tf_distrib_bench_recovery_") as directory:
        result = launch(train, 2, args=(directory, save_freq, snapshot_freq), max_restarts=1,
                        quiet=True, timeout=600, preload=preload)
        if result.exit_code or result.restarts != 1:
            raise RuntimeError(f"the recovery job did not restart once and finish: "
                               f"{result.failure_report()}")
        return _outcome(directory)


def _outcome(directory: str) -> dict:
    first = max(_read(directory, f"first-step-{i}") for i in range(2))
    return {"seconds": first - _read(directory, "killed"),
            "steps_lost": KILL_AFTER - _read(directory, "resumed-0")}


def run(options) -> dict:
    from tf_distrib.bench import pytorch_ddp, snapshot_cost

    os.environ.pop("TF_DISTRIB_PRELOAD", None)  # the default launch decides by itself
    rounds = 1 if options.quick else ROUNDS
    settings = {name: functools.partial(measure, *setting)
                for name, setting in SETTINGS.items()}
    if pytorch_ddp.available():
        settings[TORCHRUN] = _torchrun
    measured = {name: [] for name in settings}
    for _ in range(rounds):
        for name, measure_once in settings.items():
            measured[name].append(measure_once())
    report = {name: {"seconds": statistics.median(m["seconds"] for m in ms),
                     "steps_lost": statistics.median(m["steps_lost"] for m in ms),
                     "seconds_per_round": [m["seconds"] for m in ms]}
              for name, ms in measured.items()}
    print(f"{'SIGKILL of worker 1 after step 60, 2 workers, MLP + Adam':<58} "
          f"{'kill -> first step':>19} {'steps lost':>11}")
    for name, row in report.items():
        print(f"{name:<58} {row['seconds']:>17.2f} s {row['steps_lost']:>11.0f}   rounds "
              + ", ".join(f"{s:.2f}" for s in row["seconds_per_round"]))
    if not pytorch_ddp.available():
        print(f"{TORCHRUN}: torch is not installed here (pip install torch to compare)")
    return {"recovery": report, "snapshot_cost": snapshot_cost.run(rounds)}


def _torchrun() -> dict:
    """The scenario under torchrun (`--max-restarts 1`), DDP workers of `pytorch_recovery`;
    tried twice, as gloo processes now and then abort as they exit (`pytorch_ddp.measured`):
    a run counts when the restarted workers wrote what they measured."""
    from tf_distrib.cluster import free_ports

    for _ in range(2):
        with tempfile.TemporaryDirectory(prefix="tf_distrib_bench_recovery_") as directory:
            done = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--max-restarts", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{free_ports(1)[0]}", "-m",
                 "tf_distrib.bench.pytorch_recovery", directory, str(KILL_AFTER), str(STEPS),
                 str(EPOCHS)], capture_output=True, text=True, timeout=600)
            try:
                return _outcome(directory)
            except FileNotFoundError:
                print(f"  (torchrun failed with exit status {done.returncode}; once more)",
                      flush=True)
    raise RuntimeError(f"torchrun failed twice; the last time: {done.stderr[-2000:]}")
