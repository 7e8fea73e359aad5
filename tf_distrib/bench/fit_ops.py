"""Keras `fit` throughput with each cross-device op, on 4 logical CPUs.

MLP 784-512-512-10, global batch 256, `distribute_dataset` input; the best
examples/sec of epochs 2 and 3 (after tracing) from `callbacks.Throughput`: single
epochs vary by up to 2x on a 2-core machine. Runs in a fresh process.
"""

from __future__ import annotations

import json

from tf_distrib.bench import run_in_fresh_process

GLOBAL_BATCH = 256
STEPS = 160


def _measure() -> dict:
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.bench import allreduce
    from tf_distrib.bench.models import mlp

    td.use_logical_cpus(4)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    x = np.random.default_rng(0).random((GLOBAL_BATCH * STEPS, 784), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, len(x)).astype("int32")
    rates = {}
    for name, make_op in allreduce.all_ops().items():
        strategy = td.HostMirroredStrategy(devices, cross_device_ops=make_op())
        with strategy.scope():
            model = mlp()
        data = td.data.distribute_dataset(
            strategy, tf.data.Dataset.from_tensor_slices((x, y)).cache(), GLOBAL_BATCH)
        history = model.fit(data, epochs=3, verbose=0,
                            callbacks=[td.callbacks.Throughput(GLOBAL_BATCH)])
        rates[name] = max(history.history["examples_per_sec"][1:])
    return rates


def run(options) -> dict:
    rates = run_in_fresh_process(__name__)
    from tf_distrib.bench.allreduce import BUILTIN_OPS

    best = max(rates[n] for n in BUILTIN_OPS)
    print(f"Keras fit, MLP 784-512-512-10, 4 logical CPUs, global batch {GLOBAL_BATCH}")
    print(f"  {'cross-device op':<44}{'examples/s':>12}{'vs best tf':>12}")
    for name, rate in rates.items():
        print(f"  {name:<44}{rate:>12.0f}{rate / best:>11.2f}x")
    return {"examples_per_sec": rates}


if __name__ == "__main__":
    print(json.dumps(_measure()))
