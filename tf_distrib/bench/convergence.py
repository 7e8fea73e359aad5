"""Does compression still learn? float32, bf16 and PowerSGD at ranks 1, 2 and 4, same run.

A learnable task shipped here: 32 Gaussian features, labelled by a fixed random teacher
network (32-32-4, tanh); a student MLP 32-256-256-4 learns it with SGD + momentum on
2 workers (`tf-distrib launch`, tf_distrib's transport), the same steps and data for every
setting. Printed per setting: the final training loss, the held-out accuracy, and the
first step (of evaluations every `EVAL_EVERY` steps) whose held-out accuracy reaches
float32's final one less 1 point. PowerSGD compresses the two larger kernels (32x256
and 256x256); it starts after its default `start_step` (100).
"""

from __future__ import annotations

import os

FEATURES, CLASSES = 32, 4
TRAIN_EXAMPLES, HELD_OUT = 32768, 4096
PER_WORKER_BATCH = 64
EPOCHS = 8  # 256 steps each at 2 workers
EVAL_EVERY = 64
TARGET_MARGIN = 0.01
SETTINGS = {"float32": None, "bf16": "bf16", "PowerSGD rank 1": 1, "PowerSGD rank 2": 2,
            "PowerSGD rank 4": 4}


def teacher_data(seed: int = 0):
    """(x_train, y_train, x_held_out, y_held_out): features and their teacher's labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((FEATURES, 32)).astype("float32") / np.sqrt(FEATURES)
    out = rng.standard_normal((32, CLASSES)).astype("float32")
    x = rng.standard_normal((TRAIN_EXAMPLES + HELD_OUT, FEATURES)).astype("float32")
    y = np.argmax(np.tanh(x @ hidden) @ out, axis=1).astype("int32")
    return x[:TRAIN_EXAMPLES], y[:TRAIN_EXAMPLES], x[TRAIN_EXAMPLES:], y[TRAIN_EXAMPLES:]


def train(compression) -> dict:
    """One worker of a 2-worker run: trains the student, evaluates it every EVAL_EVERY steps.

    Args:
        compression: None, "bf16", or a PowerSGD rank.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td

    keras.utils.set_random_seed(0)
    if isinstance(compression, int):
        compression = td.cross_device.PowerSGD(rank=compression)
    strategy = td.make_strategy(compression=compression)
    x, y, x_test, y_test = teacher_data()
    workers = int(os.environ.get("TF_DISTRIB_NUM_WORKERS", "1"))
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(CLASSES)])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                         PER_WORKER_BATCH * workers)
    curve = []

    class HeldOut(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            HeldOut.steps += 1
            if HeldOut.steps % EVAL_EVERY == 0:
                # The model's call on this worker's copy of the weights: no collective.
                logits = model(x_test, training=False)
                curve.append((HeldOut.steps, float(np.mean(np.argmax(logits, 1) == y_test))))

    history = model.fit(dataset, epochs=EPOCHS, verbose=0, callbacks=[HeldOut()])
    return {"loss": history.history["loss"][-1], "curve": curve}


def run(options) -> dict:
    from tf_distrib.launch import launch

    print(f"teacher task ({FEATURES} features, {CLASSES} classes), student MLP "
          f"{FEATURES}-256-256-{CLASSES}, SGD(0.05, momentum 0.9), 2 workers x {PER_WORKER_BATCH} "
          f"per step, {EPOCHS * TRAIN_EXAMPLES // (2 * PER_WORKER_BATCH)} steps")
    results = {}
    for name, compression in SETTINGS.items():
        result = launch(train, 2, args=(compression,), quiet=True, timeout=600)
        if result.exit_code:
            raise RuntimeError(f"{name}: {result.failure_report()}")
        results[name] = result.values[0]
    target = results["float32"]["curve"][-1][1] - TARGET_MARGIN
    print(f"  {'setting':<17}{'final loss':>11}{'held-out acc':>14}"
          f"{f'steps to {target:.1%}':>18}")
    rows = []
    for name, result in results.items():
        reached = next((step for step, accuracy in result["curve"] if accuracy >= target), None)
        accuracy = result["curve"][-1][1]
        rows.append({"setting": name, "loss": result["loss"], "accuracy": accuracy,
                     "steps_to_target": reached, "curve": result["curve"]})
        print(f"  {name:<17}{result['loss']:>11.4f}{accuracy:>14.1%}"
              f"{reached if reached is not None else '-':>18}", flush=True)
    return {"target_accuracy": target, "rows": rows}
