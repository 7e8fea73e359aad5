"""The job the simulated-host tests run on every host: `python tests/_multi_host.py OUT ...`.

Trains a small classifier under `make_strategy()` and writes its final weights to
OUT/weights-<worker index>.npz (the hosts share this machine's file system); with
`--progress`, each worker's newest finished step to OUT/progress-<worker index>.
"""

import argparse
import os


def train(epochs=2, backup_dir=None, communication_timeout=None, bucket_bytes=None, seed=1,
          snapshot_freq="auto", progress=None):
    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import make_data

    keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()
    strategy = td.make_strategy(communication_timeout=communication_timeout,
                                bucket_bytes=bucket_bytes)
    x, y = make_data(2048)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.05),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                         96)  # divides by 1 to 4 replicas
    callbacks = []
    if backup_dir:
        callbacks.append(td.callbacks.BackupAndRestore(backup_dir, save_freq=10,
                                                       delete_checkpoint=False, verbose=1,
                                                       snapshot_freq=snapshot_freq))
    if progress:
        class Progress(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                with open(f"{progress}.tmp", "w") as f:
                    f.write(str(int(self.model.optimizer.iterations.numpy())))
                os.replace(f"{progress}.tmp", progress)

        callbacks.append(Progress())
    model.fit(dataset, epochs=epochs, verbose=0, callbacks=callbacks)
    transport = getattr(strategy, "transport", None)
    return [w.numpy() for w in model.weights], transport and transport.mode


def main():
    import numpy as np

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--backup-dir")
    parser.add_argument("--communication-timeout", type=float)
    parser.add_argument("--bucket-bytes", type=int)
    parser.add_argument("--snapshot-freq", type=int)
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args()
    index = os.environ.get("TF_DISTRIB_WORKER_INDEX", "single")
    weights, mode = train(args.epochs, args.backup_dir, args.communication_timeout,
                          args.bucket_bytes, snapshot_freq=args.snapshot_freq or "auto",
                          progress=args.progress and os.path.join(args.out,
                                                                  f"progress-{index}"))
    np.savez(os.path.join(args.out, f"weights-{index}.npz"), *weights)
    print(f"trained with transport {mode}", flush=True)


if __name__ == "__main__":
    main()
