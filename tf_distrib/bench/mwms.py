"""Gradient all-reduce between 2 MultiWorkerMirroredStrategy workers over loopback.

100 MB of float32 gradients (4 tensors of 25 MB) summed across the workers: first as
Keras does without tf_distrib (one batch all-reduce, which TF packs into one tensor),
then through `make_strategy(compression=...)`'s gradient path (one collective per
bucket) in float32, bfloat16 and float16; TF's collective carries the bytes in every
case. Two references measured in the same run show what the transport allows: a bare
cast to bfloat16 around TF's all-reduce, and TF's collective on tensors that are
bfloat16 already (no cast at all: the ceiling of any bf16 scheme that keeps TF's
collective).
"""

from __future__ import annotations

import statistics

FLOATS = 25_000_000
TENSORS = 4
BASELINE = "fp32, TF (Keras' default)"
SETTINGS = {"fp32, tf_distrib": None, "bf16, tf_distrib": "bf16", "fp16, tf_distrib": "fp16"}


def _median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` (its first output fetched), after one warm-up call."""
    import time

    fn()[0].numpy()  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()[0].numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(repeats: int) -> dict:
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.cross_device.gradients import GradientAllReduce

    strategy = td.make_strategy()
    grads = [tf.random.stateless_normal([FLOATS // TENSORS], seed=[i, 0])
             for i in range(TENSORS)]

    def replica_all_reduce(values):
        return tf.distribute.get_replica_context().all_reduce("SUM", values)

    # What Keras' optimizer runs without tf_distrib: one batch all-reduce of every gradient.
    results = {BASELINE: _median_seconds(
        tf.function(lambda: strategy.run(lambda: replica_all_reduce(list(grads)))), repeats)}
    for name, compression in SETTINGS.items():
        reduce = GradientAllReduce(compression)

        @tf.function
        def all_reduce(reduce=reduce):
            return strategy.run(lambda: reduce(list(grads)))

        results[name] = _median_seconds(all_reduce, repeats)

    @tf.function
    def bare_cast():
        def reduce():
            sent = [tf.cast(g, tf.bfloat16) for g in grads]
            return [tf.cast(g, tf.float32) for g in replica_all_reduce(sent)]
        return strategy.run(reduce)

    results["reference: bare bf16 cast"] = _median_seconds(bare_cast, repeats)
    halves = [tf.cast(g, tf.bfloat16) for g in grads]
    results["reference: bf16 transport only"] = _median_seconds(
        tf.function(lambda: strategy.run(lambda: [replica_all_reduce(h) for h in halves])),
        repeats)
    return results


def run(options) -> dict:
    from tf_distrib.launch import launch

    result = launch(_worker, 2, args=(2 if options.quick else 5,), quiet=True, timeout=600)
    if result.exit_code:
        raise RuntimeError(result.failure_report())
    seconds = result.values[0]
    base = seconds[BASELINE]
    print(f"2 MWMS workers on 127.0.0.1, {FLOATS * 4 / 1e6:.0f} MB of float32 gradients")
    print(f"  {'gradient all-reduce':<32}{'seconds':>9}{'speed-up vs TF fp32':>21}")
    for name, s in seconds.items():
        print(f"  {name:<32}{s:>9.3f}{base / s:>20.2f}x")
    return {"seconds": seconds, "speedup_vs_fp32": {k: base / v for k, v in seconds.items()}}
