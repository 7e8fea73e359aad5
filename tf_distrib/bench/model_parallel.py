"""Memory per device with `model_parallel.pipeline`: each of k devices holds about 1/k.

An MLP 1024-2048x3-1024-10 with Adam (weights and slots), split over 2 and 4 logical
CPUs, next to the same model on one device. Runs in a fresh process (logical devices
are fixed once TensorFlow starts).
"""

from __future__ import annotations

import json

from tf_distrib.bench import run_in_fresh_process


def _measure() -> dict:
    import keras
    import numpy as np

    import tf_distrib as td

    td.use_logical_cpus(4)
    x = np.zeros((8, 1024), "float32")
    y = np.zeros(8, "int32")

    def model():
        return keras.Sequential([keras.Input((1024,))]
                                + [keras.layers.Dense(2048, activation="relu") for _ in range(3)]
                                + [keras.layers.Dense(1024), keras.layers.Dense(10)])

    results = {}
    for k in (1, 2, 4):
        piped = td.model_parallel.pipeline(model(), [f"/cpu:{i}" for i in range(k)])
        piped.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        piped.fit(x, y, verbose=0)  # builds the optimizer's slots
        usage = td.model_parallel.memory_per_device(piped)
        results[f"{k} device(s)"] = {d.rsplit("/", 1)[-1]: u for d, u in sorted(usage.items())}
    return results


def run(options) -> dict:
    results = run_in_fresh_process(__name__)
    total = sum(u["bytes"] for u in results["1 device(s)"].values())
    print(f"MLP 1024-2048x3-1024-10 + Adam: {total / 1e6:.1f} MB of weights and slots")
    print(f"  {'layout':<12}{'device':<10}{'parameters':>12}{'MB':>8}{'share':>8}")
    for layout, usage in results.items():
        for device, u in usage.items():
            print(f"  {layout:<12}{device:<10}{u['parameters']:>12,}{u['bytes'] / 1e6:>8.1f}"
                  f"{u['bytes'] / total:>8.0%}")
    return results


if __name__ == "__main__":
    print(json.dumps(_measure()))
