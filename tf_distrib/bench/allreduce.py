"""Batch all-reduce of a realistic gradient set on 4 logical CPUs, per cross-device op.

Each op runs the way Keras' `fit` uses it: `replica_context.all_reduce(SUM, grads)`
inside a `tf.function` under a MirroredStrategy built with that op. numpy's sum of
the same arrays is the memory-bandwidth reference. Runs in a fresh process (logical
devices are fixed once TensorFlow starts).
"""

from __future__ import annotations

import json
import sys
import time

from tf_distrib.bench import run_in_fresh_process

REPLICAS = 4
# (name, total floats, tensors): big layers, and many small ones.
GRADIENT_SETS = (("10M floats in 50 tensors", 10_000_000, 50),
                 ("1M floats in 500 tensors", 1_000_000, 500))


def gradient_shapes(total: int, count: int, seed: int = 0) -> list[int]:
    """Sizes of `count` tensors adding up to `total`, unequal like a model's layers."""
    import numpy as np

    weights = np.random.default_rng(seed).lognormal(0.0, 1.0, count)
    sizes = np.maximum(1, (weights / weights.sum() * total).astype(int))
    sizes[0] += total - sizes.sum()
    return sizes.tolist()


BUILTIN_OPS = ("tf ReductionToOneDevice", "tf HierarchicalCopyAllReduce",
               "tf default (CollectiveAllReduce ring)")


def builtin_ops() -> dict:
    """Name -> factory of each TensorFlow built-in cross-device op (None: TF's default)."""
    import tensorflow as tf

    return dict(zip(BUILTIN_OPS, (tf.distribute.ReductionToOneDevice,
                                  lambda: tf.distribute.HierarchicalCopyAllReduce(REPLICAS),
                                  lambda: None), strict=True))


def all_ops() -> dict:
    """Every op the benchmark compares: TF's built-ins, then tf_distrib's."""
    from tf_distrib.cross_device import BucketedAllReduce, CompressedAllReduce, RingAllReduce

    return {**builtin_ops(),
            "tf_distrib BucketedAllReduce": BucketedAllReduce,
            "tf_distrib Bucketed + Ring": lambda: BucketedAllReduce(inner=RingAllReduce()),
            "tf_distrib Bucketed + Compressed bf16": lambda: BucketedAllReduce(
                inner=CompressedAllReduce("bfloat16")),
            "tf_distrib Bucketed + Compressed fp16": lambda: BucketedAllReduce(
                inner=CompressedAllReduce("float16"))}


def measure(ops: dict, repeats: int = 5, sets=GRADIENT_SETS) -> dict:
    """ms per batch all-reduce for each op, on each gradient set; needs 4 logical CPUs.

    Args:
        ops: Name -> factory of a CrossDeviceOps (None: TF's default).
        repeats: Timed repetitions. Defaults to 5.
        sets: (name, total floats, tensors) gradient sets. Defaults to `GRADIENT_SETS`.
    """
    import numpy as np
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:REPLICAS]
    prepared = []
    for set_name, total, count in sets:
        arrays = [[np.random.default_rng(r * 1000 + i).standard_normal(n).astype(np.float32)
                   for i, n in enumerate(gradient_shapes(total, count))]
                  for r in range(REPLICAS)]
        start = time.perf_counter()
        for _ in range(repeats):
            [sum(replica[i] for replica in arrays) for i in range(count)]
        reference = (time.perf_counter() - start) / repeats * 1e3
        prepared.append((set_name, total, count, arrays,
                         {"numpy sum (memory-bandwidth reference)": reference}))
    for name, make_op in ops.items():
        # One strategy per op: TF's collectives reuse instance keys across strategies.
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=make_op())
        for _, _, _, arrays, timings in prepared:
            values = strategy.experimental_distribute_values_from_function(
                lambda ctx, arrays=arrays: [tf.constant(a)
                                            for a in arrays[ctx.replica_id_in_sync_group]])

            @tf.function
            def all_reduce(values, strategy=strategy):
                return strategy.run(lambda *g: tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, list(g)), args=tuple(values))

            reduced = all_reduce(values)  # trace, and check the result once (16-bit
            # compression included: the exact bounds are tested in tests/)
            np.testing.assert_allclose(strategy.experimental_local_results(reduced[0])[0],
                                       sum(replica[0] for replica in arrays), rtol=5e-2,
                                       atol=5e-2)
            start = time.perf_counter()
            for _ in range(repeats):
                reduced = all_reduce(values)
            strategy.experimental_local_results(reduced[-1])[0].numpy()
            timings[name] = (time.perf_counter() - start) / repeats * 1e3
    return {set_name: {"floats": total, "tensors": count, "ms": timings}
            for set_name, total, count, _, timings in prepared}


def print_table(results: dict, builtin_names) -> None:
    for set_name, r in results.items():
        best = min(r["ms"][n] for n in builtin_names)
        print(f"{set_name} ({r['floats'] * 4 / 1e6:.0f} MB per replica, {REPLICAS} replicas)")
        print(f"  {'op':<44}{'ms':>9}{'GB/s':>8}{'vs best tf':>12}")
        for name, ms in r["ms"].items():
            gbps = r["floats"] * 4 * REPLICAS / (ms / 1e3) / 1e9
            print(f"  {name:<44}{ms:>9.1f}{gbps:>8.2f}{best / ms:>11.2f}x")


def run(options) -> dict:
    repeats = 2 if options.quick else 5
    results = run_in_fresh_process(__name__, repeats)
    print_table(results, BUILTIN_OPS)
    return results


if __name__ == "__main__":
    import tf_distrib as td

    td.use_logical_cpus(REPLICAS)
    print(json.dumps(measure(all_ops(), int(sys.argv[1]))))
