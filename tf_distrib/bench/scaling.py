"""Scaling: 2 MWMS workers pinned to one core each against 1 worker on one core.

Each worker is pinned to its own core (`os.sched_setaffinity`, as `taskset -c i` would)
with one intra-op thread, and trains an MLP 784-1024-1024-10 on 128 examples per
worker per step, on `distribute_dataset(repeat=True)` so that `fit` keeps one iterator.
The ratio of global examples/sec (2 workers / 1 worker) is the scaling; 2.0 is perfect,
Horovod's headline is 90% (1.8). TensorFlow's collective over loopback is the transport
in every setting. Each setting runs twice and keeps its best: with every core busy,
single runs vary by up to 2x.
"""

from __future__ import annotations

import os

PER_WORKER_BATCH = 128
STEPS = 60
SETTINGS = {"fp32": {}, "bf16": {"compression": "bf16"},
            "bucketed": {"bucket_bytes": 25 * 2**20},
            "bf16 + bucketed": {"compression": "bf16", "bucket_bytes": 25 * 2**20}}


def _worker(settings: dict) -> float:
    index = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    os.sched_setaffinity(0, {index % os.cpu_count()})
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tf_distrib as td
    from tf_distrib.bench.models import mlp

    strategy = td.make_strategy(**settings)
    workers = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    global_batch = PER_WORKER_BATCH * workers
    x = np.random.default_rng(0).random((global_batch * STEPS, 784), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, len(x)).astype("int32")
    with strategy.scope():
        model = mlp((1024, 1024))
    data = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                      global_batch, repeat=True)
    history = model.fit(data, epochs=2, steps_per_epoch=data.steps_per_epoch, verbose=0,
                        callbacks=[td.callbacks.Throughput(global_batch)])
    return history.history["examples_per_sec"][-1]


def run(options) -> dict:
    from tf_distrib.launch import launch

    def throughput(workers, settings):
        rates = []
        for _ in range(2):
            result = launch(_worker, workers, args=(settings,), quiet=True, timeout=600)
            if result.exit_code:
                raise RuntimeError(result.failure_report())
            rates.append(result.values[0])
        return max(rates)

    one = throughput(1, {})
    results = {"1 worker, 1 core": one}
    print(f"MLP 784-1024-1024-10, {PER_WORKER_BATCH} examples per worker per step, one core "
          "and one intra-op thread per worker")
    print(f"  {'setting':<26}{'examples/s':>12}{'scaling':>10}")
    print(f"  {'1 worker':<26}{one:>12.0f}{1.0:>9.2f}x")
    for name, settings in SETTINGS.items():
        rate = throughput(2, settings)
        results[f"2 workers, {name}"] = rate
        print(f"  {'2 workers, ' + name:<26}{rate:>12.0f}{rate / one:>9.2f}x")
    return {"examples_per_sec": results}
