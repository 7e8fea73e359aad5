"""A small deterministic training job that tests run in worker processes."""

KILL_SIGNALS = {"SIGKILL": 9, "SIGTERM": 15}


def train_with_backup(backup_dir, epochs=3, save_freq=10, kill_at=None, kill_worker=0,
                      kill_with="SIGKILL", logical_cpus=None, num_examples=1024,
                      global_batch_size=32, slow_saves=None, shuffle_buffer=None,
                      repeat=False, kill_when_saved=False, late_watcher=False,
                      snapshot_freq="auto", hosts_of_their_own=False, transport=None,
                      compression=None):
    """Trains with BackupAndRestore; on the launcher's first attempt, worker
    `kill_worker` kills itself after `kill_at` steps. Returns weights and counters.

    `slow_saves` maps global steps to seconds their backup pauses after writing its first
    array, on the first attempt (writing happens in the background: training goes on).
    With `kill_when_saved` the kill waits (60 s at most) for the backup being written, so
    that the newest backup is the one of the last multiple of `save_freq` however loaded
    the machine is. With `late_watcher`, worker 0's preemption watcher learns a stop step
    2 s after it was published, as on a loaded machine, on the first attempt. With
    `hosts_of_their_own` each worker keeps its in-memory snapshots apart, as on a host of
    its own, and worker 1's are lost before the second attempt (a replaced host).
    """
    import os
    import signal

    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import NUM_CLASSES, NUM_FEATURES, make_data

    if logical_cpus:
        td.use_logical_cpus(logical_cpus)
    if hosts_of_their_own:
        _host_of_its_own()
    keras.utils.set_random_seed(1)
    tf.config.experimental.enable_op_determinism()
    strategy = td.make_strategy(transport=transport, compression=compression)
    x, y = make_data(num_examples)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((NUM_FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.2),  # its RNG state must be restored too
            keras.layers.Dense(NUM_CLASSES),
        ])
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    dataset = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                         global_batch_size, shuffle_buffer=shuffle_buffer,
                                         repeat=repeat)
    backup = td.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq,
                                           delete_checkpoint=False,
                                           snapshot_freq=snapshot_freq)
    if slow_saves and os.environ.get("TF_DISTRIB_ATTEMPT", "0") == "0":
        import time

        def slowly(arrays, seconds):
            for i, array in enumerate(arrays):
                yield array
                if i == 0:
                    time.sleep(seconds)

        write = backup._store.write
        backup._store.write = lambda step, arrays, *a: write(
            step, slowly(arrays, slow_saves.get(step, 0)), *a)
    callbacks = [backup]
    first_attempt = os.environ.get("TF_DISTRIB_ATTEMPT", "0") == "0"
    if late_watcher and first_attempt and os.environ["TF_DISTRIB_WORKER_INDEX"] == "0":
        import threading
        import time

        from tf_distrib import _compat

        service = _compat.coordination_service()
        get = service.get_config_key_value

        def late_get(*args):
            value = get(*args)
            if threading.current_thread().name == "tf_distrib-preemption":
                time.sleep(2)
            return value

        service.get_config_key_value = late_get
    if kill_at and first_attempt and os.environ["TF_DISTRIB_WORKER_INDEX"] == str(kill_worker):
        class Kill(keras.callbacks.Callback):
            steps = 0

            def on_train_batch_end(self, batch, logs=None):
                Kill.steps += 1
                if Kill.steps == kill_at:
                    if kill_when_saved:
                        backup._writer.wait(60)
                    os.kill(os.getpid(), getattr(signal, kill_with))

        callbacks.append(Kill())
    history = model.fit(dataset, epochs=epochs, verbose=0, callbacks=callbacks,
                        steps_per_epoch=dataset.steps_per_epoch if repeat else None)
    return {"weights": [w.numpy() for w in model.weights],
            "strategy": type(strategy).__name__,
            "replicas": strategy.num_replicas_in_sync,
            "iterations": int(model.optimizer.iterations.numpy()),
            "loss": history.history["loss"], "restored_step": backup.restored_step,
            "worker_state": sorted(td.cross_device.gradients.of_strategy(strategy).worker_state(
                model.optimizer))
            if compression else None}


def _host_of_its_own():
    """This worker's snapshots in a directory of its own, as if alone on its host."""
    import os
    import shutil

    from tf_distrib import contract

    index = contract.worker_index()
    directory = os.path.join(contract.snapshot_dir(), f"host-{index}")
    if index == 1 and contract.attempt() == 1:
        shutil.rmtree(directory)
    os.makedirs(directory, exist_ok=True)
    os.environ.update({contract.ENV_SNAPSHOT_DIR: directory, contract.ENV_LOCAL_INDEX: "0",
                       contract.ENV_LOCAL_WORKERS: "1"})


def train_on_one_cpu():
    """On a process of one CPU: the strategy `make_strategy()` returns, and a plain dataset's
    training under it and under the default strategy (plain and K=4 accumulation); the
    thread that tears a spent iterator of a dataset given to `fit` down; the warning of the
    arguments one device ignores."""
    import warnings

    import keras
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td.make_strategy(compression="bf16", bucket_bytes=1 << 20)
    strategy = td.make_strategy()
    x = np.random.default_rng(0).random((32 * 12 + 5, 16), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 4, len(x)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # finite, partial batch

    def train(under, steps):
        keras.utils.set_random_seed(0)
        with under.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(4)])
            model.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=steps),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        history = model.fit(dataset, epochs=3, verbose=0)
        return [w.numpy() for w in model.weights], history.history, model.evaluate(x, y, verbose=0)

    same = {}
    for steps in (None, 4):
        ours, default = train(strategy, steps), train(tf.distribute.get_strategy(), steps)
        same[steps] = (all(np.array_equal(a, b) for a, b in zip(ours[0], default[0], strict=True))
                       and ours[1:] == default[1:])
    torn_down, fresh = tear_down_a_spent_iterator(
        strategy.experimental_distribute_dataset(dataset))
    next(fresh)
    return {"strategy": type(strategy).__name__, "same": same, "torn_down": torn_down,
            "iterator": type(fresh._iterators[0]._iterator).__name__,
            "warnings": [str(w.message) for w in caught]}


def tear_down_a_spent_iterator(distributed):
    """Drops an iterator of `distributed` after one batch, as Keras does at each epoch of a
    finite dataset once it has made the next one.

    Returns:
        The names of the threads that tore it down within 30 s, and the next iterator.
    """
    import threading
    import time
    import weakref

    torn_down = []
    spent = iter(distributed)
    next(spent)
    weakref.finalize(spent, lambda: torn_down.append(threading.current_thread().name))
    fresh = iter(distributed)
    del spent
    deadline = time.monotonic() + 30
    while not torn_down and time.monotonic() < deadline:
        time.sleep(0.05)
    return torn_down, fresh
