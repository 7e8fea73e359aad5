"""Gradient all-reduce between 2 MultiWorkerMirroredStrategy workers over loopback.

100 MB of float32 gradients (4 tensors of 25 MB) summed across the workers: first as
Keras does without tf_distrib (one batch all-reduce on TensorFlow's collective, which
packs everything into one tensor), then through tf_distrib's gradient path
(`GradientAllReduce`: one collective per bucket) on TensorFlow's collective and on
tf_distrib's transport (shared memory, the default on one host, and TCP), in float32
and bfloat16. Each row gives the wall time, the speed-up over Keras' default and the
CPU time per MB summed (user + system, the worker's every thread). References in the
same run: a bare bf16 cast around TF's all-reduce, TF's collective on tensors that are
bfloat16 already, and `torch.distributed` (gloo) on the same bytes when torch is there.
"""

from __future__ import annotations

import os
import statistics
import time

FLOATS = 25_000_000
TENSORS = 4
MB = FLOATS * 4 / 1e6
BASELINE = "fp32, TF collective (Keras' default)"
# name -> (transport mode or None for TF's collective, compression)
SETTINGS = {
    "fp32, TF collective, tf_distrib buckets": (None, None),
    "bf16, TF collective, tf_distrib buckets": (None, "bf16"),
    "fp16, TF collective, tf_distrib buckets": (None, "fp16"),
    "fp32, tf_distrib shm": ("shm", None),
    "bf16, tf_distrib shm": ("shm", "bf16"),
    "fp32, tf_distrib tcp": ("tcp", None),
    "bf16, tf_distrib tcp": ("tcp", "bf16"),
}


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(median wall seconds, mean CPU seconds) of `fn()` (its first output fetched)."""
    fn()[0].numpy()  # trace and warm up
    times = []
    cpu = time.process_time()  # every thread of the process
    for _ in range(repeats):
        start = time.perf_counter()
        fn()[0].numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (time.process_time() - cpu) / repeats


def _worker(repeats: int) -> dict:
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib import cluster, transport
    from tf_distrib.cross_device.gradients import GradientAllReduce

    strategy = td.make_strategy(transport="tf")
    spec = cluster.from_environment()
    tasks = [f"worker:{i}" for i in range(spec.num_workers)]
    carriers = {mode: transport.connect(spec.task_index, tasks, "127.0.0.1",
                                        transport.CoordinationServiceStore(), mode=mode,
                                        prefix=f"bench/{mode}") for mode in ("shm", "tcp")}
    grads = [tf.random.stateless_normal([FLOATS // TENSORS], seed=[i, 0])
             for i in range(TENSORS)]

    def replica_all_reduce(values):
        return tf.distribute.get_replica_context().all_reduce("SUM", values)

    # What Keras' optimizer runs without tf_distrib: one batch all-reduce of every gradient.
    results = {BASELINE: _timed(
        tf.function(lambda: strategy.run(lambda: replica_all_reduce(list(grads)))), repeats)}
    for name, (mode, compression) in SETTINGS.items():
        reduce = GradientAllReduce(compression, transport=carriers.get(mode))

        @tf.function
        def all_reduce(reduce=reduce):
            return strategy.run(lambda: reduce(list(grads)))

        results[name] = _timed(all_reduce, repeats)

    @tf.function
    def bare_cast():
        def reduce():
            sent = [tf.cast(g, tf.bfloat16) for g in grads]
            return [tf.cast(g, tf.float32) for g in replica_all_reduce(sent)]
        return strategy.run(reduce)

    results["reference: bare bf16 cast, TF collective"] = _timed(bare_cast, repeats)
    halves = [tf.cast(g, tf.bfloat16) for g in grads]
    results["reference: bf16 TF collective, no cast"] = _timed(
        tf.function(lambda: strategy.run(lambda: [replica_all_reduce(h) for h in halves])),
        repeats)
    for carrier in carriers.values():
        carrier.close()
    return results


def _torch_worker(port: int, repeats: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    grads = [torch.randn(FLOATS // TENSORS) for _ in range(TENSORS)]

    class Done:
        def numpy(self):
            return None

    def all_reduce():
        for g in grads:
            dist.all_reduce(g)
        return [Done()]

    result = _timed(all_reduce, repeats)
    dist.destroy_process_group()
    return result


def run(options) -> dict:
    from tf_distrib.bench import pytorch_ddp
    from tf_distrib.cluster import free_ports
    from tf_distrib.launch import launch

    repeats = 2 if options.quick else 5
    result = launch(_worker, 2, args=(repeats,), quiet=True, timeout=900)
    if result.exit_code:
        raise RuntimeError(result.failure_report())
    measured = result.values[0]
    if pytorch_ddp.available():
        torch_run = launch(_torch_worker, 2, args=(free_ports(1)[0], repeats), quiet=True,
                           startup_timeout=None, timeout=600)
        if torch_run.exit_code:
            raise RuntimeError(torch_run.failure_report())
        measured["fp32, PyTorch gloo all_reduce"] = torch_run.values[0]
    base = measured[BASELINE][0]
    print(f"2 MWMS workers on 127.0.0.1, {MB:.0f} MB of float32 gradients")
    print(f"  {'gradient all-reduce':<44}{'seconds':>9}{'vs Keras default':>18}"
          f"{'CPU ms/MB':>11}")
    for name, (seconds, cpu) in measured.items():
        print(f"  {name:<44}{seconds:>9.3f}{base / seconds:>17.2f}x{cpu / MB * 1e3:>11.2f}")
    return {"seconds": {k: v[0] for k, v in measured.items()},
            "cpu_ms_per_mb": {k: v[1] / MB * 1e3 for k, v in measured.items()},
            "speedup_vs_keras_default": {k: base / v[0] for k, v in measured.items()}}
