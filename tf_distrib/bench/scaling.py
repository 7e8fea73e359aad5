"""Scaling: 2 MWMS workers pinned to one core each against 1 worker on one core.

Each worker is pinned to its own core (`os.sched_setaffinity`, as `taskset -c i` would)
with one intra-op thread, and trains an MLP 784-1024-1024-10 on 128 examples per
worker per step, on `distribute_dataset(repeat=True)` so that `fit` keeps one iterator.
The ratio of global examples/sec (2 workers / 1 worker) is the scaling; 2.0 is perfect,
Horovod's headline is 90% (1.8). The gradient all-reduce goes through TensorFlow's
collective (gRPC) or tf_distrib's transport (shared memory, the default on one host, or
TCP); with `gradient_accumulation_steps=4` it runs once per 4 steps. PyTorch DDP
(gloo) on the same layout, when torch is installed. Each setting runs twice and keeps
its best: with every core busy, single runs vary by up to 2x.
"""

from __future__ import annotations

import os

PER_WORKER_BATCH = 128
STEPS = 200  # per epoch; the second epoch is measured
ACCUMULATION = 4
# name -> (workers, make_strategy arguments, gradient_accumulation_steps)
SETTINGS = {
    "1 worker": (1, {}, None),
    "2 workers, TF collective": (2, {"transport": "tf"}, None),
    "2 workers, tf_distrib (default: shm)": (2, {}, None),
    "2 workers, tf_distrib tcp": (2, {"transport": "tcp"}, None),
    "2 workers, TF collective + bf16": (2, {"transport": "tf", "compression": "bf16"}, None),
    "2 workers, tf_distrib + bf16": (2, {"compression": "bf16"}, None),
    f"1 worker, K={ACCUMULATION}": (1, {}, ACCUMULATION),
    f"2 workers, K={ACCUMULATION}, TF collective": (2, {"transport": "tf"}, ACCUMULATION),
    f"2 workers, K={ACCUMULATION}, tf_distrib": (2, {}, ACCUMULATION),
}


def _worker(settings: dict, accumulation: int | None) -> float:
    index = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    os.sched_setaffinity(0, {index % os.cpu_count()})
    import keras
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
        model = mlp((1024, 1024), optimizer=keras.optimizers.SGD(
            0.01, gradient_accumulation_steps=accumulation))
    data = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                      global_batch, repeat=True)
    history = model.fit(data, epochs=2, steps_per_epoch=data.steps_per_epoch, verbose=0,
                        callbacks=[td.callbacks.Throughput(global_batch)])
    return history.history["examples_per_sec"][-1]


def run(options) -> dict:
    from tf_distrib.bench import pytorch_ddp
    from tf_distrib.launch import launch

    def throughput(workers, settings, accumulation):
        rates = []
        for _ in range(1 if options.quick else 2):
            result = launch(_worker, workers, args=(settings, accumulation), quiet=True,
                            timeout=600)
            if result.exit_code:
                raise RuntimeError(result.failure_report())
            rates.append(result.values[0])
        return max(rates)

    print(f"MLP 784-1024-1024-10, {PER_WORKER_BATCH} examples per worker per step, one core "
          "and one intra-op thread per worker")
    print(f"  {'setting':<48}{'examples/s':>12}{'scaling':>10}")
    results, baselines = {}, {}
    for name, (workers, settings, accumulation) in SETTINGS.items():
        rate = throughput(workers, settings, accumulation)
        results[name] = rate
        if workers == 1:
            baselines[accumulation] = rate
        print(f"  {name:<48}{rate:>12.0f}{rate / baselines[accumulation]:>9.2f}x", flush=True)
    scaling = {name: results[name] / baselines[SETTINGS[name][2]] for name in SETTINGS}
    if pytorch_ddp.available():
        for suffix, k in (("", 1), (f", K={ACCUMULATION} (no_sync)", ACCUMULATION)):
            one = pytorch_ddp.examples_per_sec(1, accumulation=k)
            two = pytorch_ddp.examples_per_sec(2, accumulation=k)
            for name, rate in ((f"PyTorch, 1 process{suffix}", one),
                               (f"PyTorch DDP (gloo), 2 processes{suffix}", two)):
                results[name], scaling[name] = rate, rate / one
                print(f"  {name:<48}{rate:>12.0f}{rate / one:>9.2f}x", flush=True)
    else:
        print("  (PyTorch DDP row: torch is not installed)")
    return {"examples_per_sec": results, "scaling": scaling}
