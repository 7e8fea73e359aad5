"""What in-memory snapshots cost: `bench recovery`'s job without a kill, SGD and Adam.

2 workers under `launch` train the MLP 784-1024-1024-10, 128 examples per worker per
step, 96 steps, with `BackupAndRestore(dir)` (backups at each epoch's end). Steps of
one run are compared, as runs differ by more than the cost (10-30% on 2 shared cores):
after a warm-up, blocks of `BLOCK` steps snapshot every step and blocks do not, in
turns (a copy finishes in the background during the next step, so single steps would
not show its cost). With "auto", the interval it chose. Each row: the median step
without snapshots, the cost (of its step time) of a snapshot every step and at the
"auto" interval, and the most steps a crash then loses (the interval minus one);
medians over `rounds` runs of each.
"""

from __future__ import annotations

import os
import statistics
import tempfile

EPOCHS, WARM_UP, BLOCK = 3, 16, 8
_NEVER = 1 << 62


def train(directory: str, optimizer: str, snapshot_freq) -> dict:
    """One worker: trains; returns its median step with and without snapshots (in
    blocks: `snapshot_freq` 1) and the interval it snapshots at."""
    import time

    import keras

    import tf_distrib as td
    from tf_distrib.bench.recovery import mlp_job

    model, data = mlp_job(optimizer)
    backup = td.callbacks.BackupAndRestore(os.path.join(directory, "backup"),
                                           snapshot_freq=snapshot_freq, verbose=0)
    steps = {True: [], False: []}

    class Times(keras.callbacks.Callback):
        last, every, done = None, 1, 0

        def on_train_batch_end(self, batch, logs=None):
            now, self.done = time.perf_counter(), self.done + 1
            cadence = backup._cadence  # the bench reaches in: the interval, and blocks
            if snapshot_freq == 1 and self.done >= WARM_UP:
                on = (self.done - WARM_UP) // BLOCK % 2 == 0
                steps[cadence.every == 1].append(now - self.last)
                cadence.every = 1 if on else _NEVER
            self.every, self.last = cadence.every, now

    model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[backup, times := Times()])
    return {"with": statistics.median(steps[True]) if steps[True] else None,
            "without": statistics.median(steps[False]) if steps[False] else None,
            "every": times.every}


def measure(optimizer: str, snapshot_freq) -> dict:
    from tf_distrib.launch import launch

    with tempfile.TemporaryDirectory(prefix="tf_distrib_bench_snapshots_") as directory:
        result = launch(train, 2, args=(directory, optimizer, snapshot_freq), quiet=True,
                        timeout=600)
        if result.exit_code:
            raise RuntimeError(result.failure_report())
        return result.values[0]


def run(rounds: int) -> dict:
    runs = {(optimizer, freq): [] for optimizer in ("sgd", "adam") for freq in (1, "auto")}
    for _ in range(rounds):
        for (optimizer, freq), measured in runs.items():
            measured.append(measure(optimizer, freq))
    print(f"\n{'in-memory snapshots, 2 workers, MLP':<38} {'step':>9} {'snapshot':>9} "
          f"{'every step':>11} {'auto: every':>12} {'its cost':>9} {'steps lost':>11}")
    report = {}
    for optimizer in ("sgd", "adam"):
        step = statistics.median(m["without"] for m in runs[optimizer, 1])
        snapshot = statistics.median(m["with"] - m["without"] for m in runs[optimizer, 1])
        every = statistics.median(m["every"] for m in runs[optimizer, "auto"])
        report[optimizer] = row = {
            "step_ms": step * 1e3, "snapshot_ms": snapshot * 1e3, "auto_every": every,
            "every_step_cost": snapshot / step, "auto_cost": snapshot / every / step}
        print(f"{'SGD' if optimizer == 'sgd' else 'Adam':<38} {row['step_ms']:>6.1f} ms "
              f"{row['snapshot_ms']:>6.2f} ms {row['every_step_cost']:>11.1%} "
              f"{every:>6g} steps {row['auto_cost']:>9.1%} {every - 1:>11g}")
    return report
