"""Gradient all-reduce between 2 MultiWorkerMirroredStrategy workers over loopback.

100 MB of float32 gradients (4 tensors of 25 MB) summed across the workers through
`make_strategy(compression=...)`'s gradient path, in float32, bfloat16 and float16;
TF's collective all-reduce carries the bytes in every case. A bare cast to bfloat16
around TF's collective, measured in the same run, shows what the transport allows.
"""

from __future__ import annotations

import statistics

FLOATS = 25_000_000
TENSORS = 4
SETTINGS = {"fp32 (TF collective)": None, "bf16": "bf16", "fp16": "fp16"}


def _worker(repeats: int) -> dict:
    import time

    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.cross_device.gradients import GradientAllReduce

    strategy = td.make_strategy()
    grads = [tf.random.stateless_normal([FLOATS // TENSORS], seed=[i, 0])
             for i in range(TENSORS)]
    results = {}
    for name, compression in SETTINGS.items():
        reduce = GradientAllReduce(compression)

        @tf.function
        def all_reduce(reduce=reduce):
            return strategy.run(lambda: reduce(list(grads)))

        all_reduce()[0].numpy()  # trace and warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            all_reduce()[0].numpy()
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times)

    @tf.function
    def bare_cast():
        def reduce():
            context = tf.distribute.get_replica_context()
            sent = [tf.cast(g, tf.bfloat16) for g in grads]
            return [tf.cast(g, tf.float32) for g in context.all_reduce("SUM", sent)]
        return strategy.run(reduce)

    bare_cast()[0].numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        bare_cast()[0].numpy()
        times.append(time.perf_counter() - start)
    results["reference: bare bf16 cast"] = statistics.median(times)
    return results


def run(options) -> dict:
    from tf_distrib.launch import launch

    result = launch(_worker, 2, args=(2 if options.quick else 5,), quiet=True, timeout=600)
    if result.exit_code:
        raise RuntimeError(result.failure_report())
    seconds = result.values[0]
    base = seconds["fp32 (TF collective)"]
    print(f"2 MWMS workers on 127.0.0.1, {FLOATS * 4 / 1e6:.0f} MB of float32 gradients")
    print(f"  {'gradient all-reduce':<26}{'seconds':>9}{'speed-up vs fp32':>18}")
    for name, s in seconds.items():
        print(f"  {name:<26}{s:>9.3f}{base / s:>17.2f}x")
    return {"seconds": seconds, "speedup_vs_fp32": {k: base / v for k, v in seconds.items()}}
