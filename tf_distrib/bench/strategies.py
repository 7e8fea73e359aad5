"""Keras `fit` throughput: no strategy vs TF's default MirroredStrategy vs make_strategy().

MLP 784-512-512-10, global batch 256, in-memory data, on 2 and 4 logical CPUs. Each
layout runs in a fresh process (logical devices are fixed once TensorFlow starts).
OneDeviceStrategy, which communicates nothing, shows the ceiling of any strategy:
the per-step cost of Keras' replica machinery itself.
"""

from __future__ import annotations

import json
import sys
import time

from tf_distrib.bench import run_in_fresh_process

GLOBAL_BATCH = 256
CONFIGS = ("no strategy", "tf OneDeviceStrategy (ceiling)", "tf MirroredStrategy (default)",
           "make_strategy(), fit(dataset)", "make_strategy() + distribute_dataset")


def _measure(logical_cpus: int, steps: int, repeats: int) -> dict:
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.bench.models import mlp

    td.use_logical_cpus(logical_cpus)
    x = np.random.default_rng(0).random((GLOBAL_BATCH * steps, 784), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, len(x)).astype("int32")
    examples = tf.data.Dataset.from_tensor_slices((x, y)).cache()
    dataset = examples.batch(GLOBAL_BATCH)
    ours = td.make_strategy()
    runs = {
        CONFIGS[0]: (tf.distribute.get_strategy(), dataset),
        CONFIGS[1]: (tf.distribute.OneDeviceStrategy("/cpu:0"), dataset),
        CONFIGS[2]: (tf.distribute.MirroredStrategy(), dataset),
        CONFIGS[3]: (ours, dataset),
        CONFIGS[4]: (ours, td.data.distribute_dataset(ours, examples, GLOBAL_BATCH)),
    }
    rates = {}
    for name, (strategy, data) in runs.items():
        with strategy.scope():
            model = mlp()
        model.fit(data, verbose=0)  # trace and warm up
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            model.fit(data, verbose=0)
            best = max(best, GLOBAL_BATCH * steps / (time.perf_counter() - start))
        rates[name] = {"examples_per_sec": best,
                       "replicas": strategy.num_replicas_in_sync}
    return rates


def run(options) -> dict:
    steps, repeats = (10, 1) if options.quick else (60, 3)
    results = {}
    for cpus in (2, 4):
        results[f"{cpus} logical CPUs"] = run_in_fresh_process(__name__, cpus, steps, repeats)
    print(f"{'layout':<16}{'configuration':<40}{'replicas':>9}{'examples/s':>12}"
          f"{'vs none':>9}{'vs tf Mirrored':>16}")
    for layout, rates in results.items():
        base = rates[CONFIGS[0]]["examples_per_sec"]
        mirrored = rates[CONFIGS[2]]["examples_per_sec"]
        for name, r in rates.items():
            r["ratio_to_no_strategy"] = r["examples_per_sec"] / base
            r["ratio_to_tf_mirrored"] = r["examples_per_sec"] / mirrored
            print(f"{layout:<16}{name:<40}{r['replicas']:>9}{r['examples_per_sec']:>12.0f}"
                  f"{r['ratio_to_no_strategy']:>8.2f}x{r['ratio_to_tf_mirrored']:>15.2f}x")
    return {"model": "MLP 784-512-512-10", "global_batch": GLOBAL_BATCH, "results": results}


if __name__ == "__main__":
    print(json.dumps(_measure(*map(int, sys.argv[1:4]))))
