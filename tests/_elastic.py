"""The job the elastic-launch tests run: counts how often each example is trained on."""

import json
import os
import signal

NUM_EXAMPLES = 1024  # 16 steps of 64 per epoch
GLOBAL_BATCH = 64


def train(scratch, epochs=2, kill_at=None, slot_fails=(), step_seconds=0.0, save_freq=5,
          snapshot_freq="auto"):
    """Trains with BackupAndRestore; records, per epoch, how often each example was used.

    The labels are the examples' ids (the loss uses id % 4 as the class), so a metric can
    count the ids it sees; BackupAndRestore saves and restores that metric mid-epoch, so
    after a restart the counts cover the whole interrupted epoch.

    Args:
        scratch: A directory shared by every attempt.
        kill_at: On attempt 0, worker 1 SIGKILLs itself after this many steps.
        slot_fails: Attempts on which worker 1 exits with status 3 before it starts.
        step_seconds: Sleep after each step (a slower job, for the grow-back test).
        snapshot_freq: BackupAndRestore's; in-memory snapshots hold no metrics, so a
            resume from one restarts the interrupted epoch's counts at 0.
    """
    attempt = int(os.environ["TF_DISTRIB_ATTEMPT"])
    index = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    workers = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    if index == 1 and attempt in slot_fails:
        raise SystemExit(3)
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import make_data

    keras.utils.set_random_seed(1)
    tf.config.experimental.enable_op_determinism()
    strategy = td.make_strategy()
    x, _ = make_data(NUM_EXAMPLES)
    ids = np.arange(NUM_EXAMPLES, dtype="int32")

    class SeenIds(keras.metrics.Metric):
        def __init__(self, **kwargs):
            super().__init__(name="seen", **kwargs)
            self.counts = self.add_variable((NUM_EXAMPLES,), "zeros", dtype="float32",
                                            aggregation="sum", name="counts")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.counts.assign_add(tf.math.bincount(tf.cast(tf.reshape(y_true, [-1]), "int32"),
                                                    minlength=NUM_EXAMPLES,
                                                    maxlength=NUM_EXAMPLES, dtype="float32"))

        def result(self):
            return tf.reduce_max(self.counts)

    def loss(y_true, y_pred):
        return keras.losses.sparse_categorical_crossentropy(
            tf.math.floormod(tf.cast(y_true, "int32"), 4), y_pred, from_logits=True)

    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        seen_ids = SeenIds()
        model.compile(keras.optimizers.SGD(0.05), loss, metrics=[seen_ids])
    dataset = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, ids)),
                                         GLOBAL_BATCH)
    seen = []

    class Record(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            Record.steps += 1
            time.sleep(step_seconds)
            if attempt == 0 and index == 1 and Record.steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_end(self, epoch, logs=None):
            counts = tf.convert_to_tensor(seen_ids.counts.value).numpy()
            seen.append({"epoch": epoch, "min": float(counts.min()), "max": float(counts.max())})

    backup = td.callbacks.BackupAndRestore(os.path.join(scratch, "backup"),
                                           save_freq=save_freq, delete_checkpoint=False,
                                           snapshot_freq=snapshot_freq)
    history = model.fit(dataset, epochs=epochs, verbose=0, callbacks=[backup, Record()])
    summary = {"workers": workers, "attempt": attempt, "restored_step": backup.restored_step,
               "seen": seen, "loss": history.history["loss"]}
    with open(os.path.join(scratch, f"summary-{attempt}-{index}.json"), "w") as f:
        json.dump(summary, f)
    return summary
