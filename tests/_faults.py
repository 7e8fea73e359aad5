"""Training jobs that misbehave on purpose: stall, straggle, save slowly (worker processes)."""

import itertools
import os
import signal
import time

from tf_distrib.chaos.faults import signal_on_entering

STEPS_PER_EPOCH = 32


def train(backup_dir=None, epochs=3, stall_at=None, stall_in="callback", stop_at=None,
          slow_worker=None, slow_seconds=0.05, slow_save=None, hang_timeout=None,
          stop_in=None, slow_start=None, plain=False):
    """Trains the blobs MLP on 2+ workers; on the first attempt, worker 1 misbehaves.

    Args:
        stall_at: Worker 1 stops stepping after this many steps: it sleeps forever in a
            callback ("callback") or in its input pipeline ("input").
        stop_at: Worker 1 sends itself SIGSTOP after this many steps.
        slow_worker: This worker's input pipeline takes `slow_seconds` longer per step.
        slow_save: Each backup takes this many seconds longer to write.
        stop_in: Worker 1 sends itself SIGSTOP as it enters this start-up phase
            (`tf_distrib.health.phases`); in "cluster", 0.5 s after it, while it waits for
            worker 0, which starts 3 s late.
        slow_start: Worker 1 sleeps this many seconds before `make_strategy`.
        plain: Pass `fit` a batched, finite `tf.data.Dataset` (as Keras' tutorials do)
            instead of `td.data.distribute_dataset`'s.
    """
    index = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    first_attempt = os.environ.get("TF_DISTRIB_ATTEMPT", "0") == "0"
    misbehaves = first_attempt and index == 1
    if misbehaves and stop_in is not None:
        signal_on_entering(stop_in, signal.SIGSTOP)
    if first_attempt and stop_in == "cluster" and index == 0:
        time.sleep(3)
    if misbehaves and slow_start:
        time.sleep(slow_start)

    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import make_data

    keras.utils.set_random_seed(1)
    tf.config.experimental.enable_op_determinism()
    strategy = td.make_strategy(hang_timeout=hang_timeout)
    x, y = make_data(STEPS_PER_EPOCH * 64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.05),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    source = tf.data.Dataset.from_tensor_slices((x, y))
    if misbehaves and stall_in == "input" and stall_at is not None:
        def pause(position):
            # Every worker reads every example ("data" sharding): position // 64 is the step.
            if position // 64 >= stall_at:
                time.sleep(10_000)
            return position

        source = source.enumerate().map(
            lambda i, e: (tf.numpy_function(pause, [i], tf.int64), e)).map(lambda i, e: e)
    if slow_worker is not None:
        # Every worker builds the same pipeline, as a plain dataset needs to skip
        # TensorFlow's per-step data check (`tf_distrib.strategy._equal_batches`); one sleeps.
        examples = itertools.count()

        def slow_down(features):
            if slow_worker == index and next(examples) % 64 == 0:
                time.sleep(slow_seconds)
            return features

        source = source.map(lambda f, label: (tf.ensure_shape(
            tf.numpy_function(slow_down, [f], tf.float32), f.shape), label))

    if plain:
        dataset, steps = source.batch(64), None
    else:
        dataset = td.data.distribute_dataset(strategy, source, 64, repeat=True)
        steps = STEPS_PER_EPOCH
    callbacks = [td.callbacks.Throughput(64)]
    backup = None
    if backup_dir:
        backup = td.callbacks.BackupAndRestore(backup_dir, save_freq=10,
                                               delete_checkpoint=False, async_save=False)
        if slow_save:
            write = backup._store.write
            backup._store.write = lambda *a, **k: (time.sleep(slow_save), write(*a, **k))[1]
        callbacks.append(backup)
    if misbehaves and (stop_at or (stall_in == "callback" and stall_at)):
        class Stall(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 == stop_at:
                    os.kill(os.getpid(), signal.SIGSTOP)
                if batch + 1 == stall_at:
                    time.sleep(10_000)

        callbacks.append(Stall())
    history = model.fit(dataset, epochs=epochs, steps_per_epoch=steps, verbose=0,
                        callbacks=callbacks)
    return {"weights": [w.numpy() for w in model.weights],
            "restored_step": backup.restored_step if backup else None,
            "history": history.history}
