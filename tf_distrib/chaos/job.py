"""The chaos trials' job: a small MLP on 2 workers, backed up asynchronously every 10 steps,
with in-memory snapshots every 3.

It runs under `tf-distrib launch` with the trial's faults (`tf_distrib.chaos.faults`)
and returns the sha256 of its final weights, which a fault-free run must match bitwise.
"""

from __future__ import annotations

import hashlib

from tf_distrib import contract
from tf_distrib.chaos import faults as chaos_faults

STEPS_PER_EPOCH = 32
EPOCHS = 3
BATCH = 64


def train(backup_dir: str, faults: list[dict] = ()) -> dict:
    """Trains for `EPOCHS` x `STEPS_PER_EPOCH` steps under `faults`; returns the digest.

    Args:
        backup_dir: Where BackupAndRestore keeps its backups (one per trial).
        faults: The trial's faults, as `dataclasses.asdict(Fault)`. Defaults to none.
    """
    callbacks = chaos_faults.inject([chaos_faults.Fault(**f) for f in faults],
                                    contract.attempt(), contract.worker_index(), backup_dir)
    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import make_data

    keras.utils.set_random_seed(1)
    tf.config.experimental.enable_op_determinism()
    strategy = td.make_strategy()
    x, y = make_data(STEPS_PER_EPOCH * BATCH)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(keras.optimizers.Adam(1e-2),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                         BATCH, shuffle_buffer=STEPS_PER_EPOCH * BATCH, seed=1,
                                         repeat=True)
    backup = td.callbacks.BackupAndRestore(backup_dir, save_freq=chaos_faults.SAVE_EVERY,
                                           delete_checkpoint=False, verbose=0,
                                           snapshot_freq=chaos_faults.SNAPSHOT_EVERY)
    model.fit(dataset, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, verbose=0,
              callbacks=[backup, *callbacks])
    digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in model.weights))
    return {"digest": digest.hexdigest(), "restored_step": backup.restored_step}
