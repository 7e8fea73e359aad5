"""GPU throughput: Keras `fit` with and without tf_distrib on the machine's GPUs.

MLP 784-2048-2048-10, global batch 1024, in-memory data. On one GPU: no strategy in
float32 and in mixed_float16. On two or more, also TensorFlow's MirroredStrategy
(NCCL) and `make_strategy()` with and without bf16 gradient compression. Prints nothing
but a note on machines without GPUs.
"""

from __future__ import annotations

import time

BATCH = 1024
STEPS = 100


def _measure() -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.bench.models import mlp

    gpus = tf.config.list_physical_devices("GPU")
    x = np.random.default_rng(0).random((BATCH * STEPS, 784), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, len(x)).astype("int32")
    examples = tf.data.Dataset.from_tensor_slices((x, y)).cache()

    def rate(strategy, policy="float32"):
        keras.mixed_precision.set_global_policy(policy)
        with strategy.scope():
            model = mlp((2048, 2048))
        dataset = td.data.distribute_dataset(strategy, examples, BATCH)
        model.fit(dataset, epochs=1, verbose=0)  # trace and warm up
        start = time.perf_counter()
        model.fit(dataset, epochs=2, verbose=0)
        return 2 * STEPS * BATCH / (time.perf_counter() - start)

    results = {"gpus": [g.name for g in gpus],
               "no strategy, float32": rate(tf.distribute.get_strategy()),
               "no strategy, mixed_float16": rate(tf.distribute.get_strategy(),
                                                  "mixed_float16")}
    if len(gpus) > 1:
        results["tf MirroredStrategy (NCCL)"] = rate(tf.distribute.MirroredStrategy())
        results["make_strategy()"] = rate(td.make_strategy())
        results["make_strategy(compression='bf16')"] = rate(td.make_strategy(compression="bf16"))
    return results


def run(options) -> dict:
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):
        print("no GPU on this machine: nothing to measure (run `make gpu-check` on one)")
        return {}
    results = _measure()
    base = results["no strategy, float32"]
    print(f"Keras fit, MLP 784-2048-2048-10, global batch {BATCH}, GPUs: {results['gpus']}")
    print(f"  {'setting':<40}{'examples/s':>12}{'vs float32':>12}")
    for name, value in results.items():
        if name != "gpus":
            print(f"  {name:<40}{value:>12.0f}{value / base:>11.2f}x")
    return results
