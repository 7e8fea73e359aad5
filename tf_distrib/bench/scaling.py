"""Scaling: 2 MWMS workers pinned to one core each against 1 worker on one core.

Each worker is pinned to its own core (`os.sched_setaffinity`, as `taskset -c i` would)
with one intra-op thread, and trains an MLP 784-1024-1024-10 on 128 examples per
worker per step, on `distribute_dataset(repeat=True)` so that `fit` keeps one iterator.
The ratio of global examples/sec (2 workers / 1 worker) is the scaling; 2.0 is perfect,
Horovod's headline is 90% (1.8). Two workers that train alone, without communicating,
give the ceiling for these cores. The gradient all-reduce goes through TensorFlow's
collective (gRPC) or tf_distrib's transport (shared memory, the default on one host, or
TCP); with `gradient_accumulation_steps=4` it runs once per 4 steps. PyTorch DDP
(gloo) on the same layout, when torch is installed. Every setting runs once per round, in 3
rounds, and the scaling is the median over rounds of a setting's rate over the one-worker
rate of its own round: the development VM switches between two speeds (25% apart) every
few seconds to minutes, and comparing best runs from different moments put the
one-worker baseline and the two-worker runs in different phases (tf_distrib's scaling
came out 1.15x, 1.37x and 1.61x on three days).
"""

from __future__ import annotations

import os
import statistics

PER_WORKER_BATCH = 128
STEPS = 200  # per epoch; the second epoch is measured
ACCUMULATION = 4
ROUNDS = 3
# name -> (workers, make_strategy arguments, gradient_accumulation_steps); no arguments:
# each worker trains alone, the most two processes can do on these cores.
SETTINGS = {
    "1 worker": (1, {}, None),
    "2 workers, no communication (the ceiling)": (2, None, None),
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

    workers = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    if settings is None:
        del os.environ["TF_CONFIG"]
        settings, workers = {}, 1
    strategy = td.make_strategy(**settings)
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

    def tf_rate(workers, settings, accumulation):
        result = launch(_worker, workers, args=(settings, accumulation), quiet=True,
                        timeout=600)
        if result.exit_code:
            raise RuntimeError(result.failure_report())
        return sum(result.values) if settings is None else result.values[0]

    # name -> (the one-worker setting it is compared to, a run returning examples/s)
    runs = {name: (f"1 worker, K={k}" if k else "1 worker",
                   lambda w=workers, s=settings, k=k: tf_rate(w, s, k))
            for name, (workers, settings, k) in SETTINGS.items()}
    if pytorch_ddp.available():
        for suffix, k in (("", 1), (f", K={ACCUMULATION} (no_sync)", ACCUMULATION)):
            for name, workers in ((f"PyTorch, 1 process{suffix}", 1),
                                  (f"PyTorch DDP (gloo), 2 processes{suffix}", 2)):
                runs[name] = (f"PyTorch, 1 process{suffix}", lambda w=workers, k=k:
                              pytorch_ddp.examples_per_sec(w, accumulation=k))
    rates = {name: [] for name in runs}
    for _ in range(1 if options.quick else ROUNDS):
        for name, (_, rate) in runs.items():
            rates[name].append(rate())
    scaling_per_round = {
        name: [r / one for r, one in zip(rates[name], rates[baseline], strict=True)]
        for name, (baseline, _) in runs.items()}
    results = {name: statistics.median(r) for name, r in rates.items()}
    scaling = {name: statistics.median(s) for name, s in scaling_per_round.items()}
    print(f"MLP 784-1024-1024-10, {PER_WORKER_BATCH} examples per worker per step, one core "
          f"and one intra-op thread per worker; medians of {len(rates['1 worker'])} round(s)")
    print(f"  {'setting':<48}{'examples/s':>12}{'scaling':>10}")
    for name in runs:
        print(f"  {name:<48}{results[name]:>12.0f}{scaling[name]:>9.2f}x")
    if not pytorch_ddp.available():
        print("  (PyTorch DDP row: torch is not installed)")
    return {"examples_per_sec": results, "scaling": scaling,
            "scaling_per_round": scaling_per_round}
