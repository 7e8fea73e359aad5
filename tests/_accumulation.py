"""Training jobs for the gradient-accumulation tests (run in worker processes)."""

STEPS_PER_EPOCH = 32


def train(global_batch, steps, optimizer="sgd", compression=None, transport=None,
          logical_cpus=None, epochs=2, backup_dir=None, kill_at=None, save_freq=10,
          counting=False, momentum=0.0, keras_own=False):
    """Trains a small MLP with `gradient_accumulation_steps=steps` under make_strategy()
    (`keras_own`: under TensorFlow's default strategy, where Keras accumulates).

    Returns the weights, the optimizer's update count, and how many gradient
    all-reduces ran (the transport's, or a counting cross-device op's).
    """
    import os
    import signal

    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import make_data

    if logical_cpus:
        td.use_logical_cpus(logical_cpus)
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    counter = None
    kwargs = {"compression": compression, "transport": transport}
    if counting:
        counter = CountingReduce()
        kwargs["cross_device_ops"] = counter
    strategy = td.make_strategy(**kwargs) if (
        (logical_cpus or os.environ.get("TF_CONFIG")) and not keras_own) \
        else tf.distribute.get_strategy()
    x, y = make_data(STEPS_PER_EPOCH * global_batch * (steps or 1))
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        if optimizer == "sgd":
            opt = keras.optimizers.SGD(0.1, momentum, gradient_accumulation_steps=steps)
        else:
            opt = keras.optimizers.Adam(0.01, gradient_accumulation_steps=steps)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                         global_batch)
    callbacks = []
    backup = None
    if backup_dir:
        backup = td.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq,
                                               delete_checkpoint=False)
        callbacks.append(backup)
    if kill_at and os.environ.get("TF_DISTRIB_ATTEMPT", "0") == "0" \
            and os.environ.get("TF_DISTRIB_WORKER_INDEX", "0") == "1":
        class Kill(keras.callbacks.Callback):
            seen = 0

            def on_train_batch_end(self, batch, logs=None):
                Kill.seen += 1
                if Kill.seen == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

        callbacks.append(Kill())
    history = model.fit(dataset, epochs=epochs, verbose=0, callbacks=callbacks)
    transport = getattr(strategy, "transport", None)
    return {"weights": [w.numpy() for w in model.weights],
            "updates": int(model.optimizer.iterations.numpy()),
            "loss": history.history["loss"],
            "transport": transport and transport.mode,
            "collectives": transport.stats.collectives if transport else None,
            "counted": int(counter.count.numpy()) if counter else None,
            "restored_step": backup.restored_step if backup else None}


def CountingReduce():
    """ReductionToOneDevice that counts the batch reductions it runs (gradient all-reduces)."""
    import tensorflow as tf

    class Counting(tf.distribute.ReductionToOneDevice):
        def __init__(self):
            super().__init__()
            self.count = tf.Variable(0, trainable=False)

        def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
            with tf.control_dependencies([self.count.assign_add(1)]):
                return super().batch_reduce_implementation(reduce_op, value_destination_pairs,
                                                           options)

    return Counting()
