"""The input pipeline is never the bottleneck: distribute_dataset alone vs training.

On 2 logical CPUs with make_strategy(): steps/s of iterating the distributed dataset
alone (tf_distrib's distribute_dataset, and TF's built-in experimental_distribute_dataset
on the same data), next to steps/s of the demo model's `fit` on it. Goal: >= 5x.
Runs in a fresh process (logical devices are fixed once TensorFlow starts).
"""

from __future__ import annotations

import json
import sys
import time

from tf_distrib.bench import run_in_fresh_process

GLOBAL_BATCH = 64


def _measure(epochs: int) -> dict:
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import build_model, make_data

    td.use_logical_cpus(2)
    strategy = td.make_strategy()
    x, y = make_data()
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    ours = td.data.distribute_dataset(strategy, examples, GLOBAL_BATCH,
                                      shuffle_buffer=len(x), seed=1)
    builtin = strategy.experimental_distribute_dataset(
        examples.shuffle(len(x), seed=1).batch(GLOBAL_BATCH, drop_remainder=True))

    def iterate(dataset):
        steps = 0
        start = time.perf_counter()
        for _ in range(epochs):
            for _ in dataset:
                steps += 1
        return steps / (time.perf_counter() - start)

    iterate(ours), iterate(builtin)  # warm up
    rates = {"distribute_dataset (iterate only)": iterate(ours),
             "tf experimental_distribute_dataset (iterate only)": iterate(builtin)}
    with strategy.scope():
        model = build_model()
    model.fit(ours, epochs=1, verbose=0)
    start = time.perf_counter()
    history = model.fit(ours, epochs=epochs, verbose=0)
    rates["demo model fit"] = len(history.epoch) * ours.steps_per_epoch / (
        time.perf_counter() - start)
    return rates


def run(options) -> dict:
    epochs = 1 if options.quick else 3
    rates = run_in_fresh_process(__name__, epochs)
    fit = rates["demo model fit"]
    print(f"{'pipeline (2 logical CPUs, global batch 64)':<52}{'steps/s':>10}{'vs fit':>9}")
    for name, rate in rates.items():
        print(f"{name:<52}{rate:>10.0f}{rate / fit:>8.1f}x")
    return {"steps_per_sec": rates, "ratio_to_fit": {k: v / fit for k, v in rates.items()}}


if __name__ == "__main__":
    print(json.dumps(_measure(int(sys.argv[1]))))
