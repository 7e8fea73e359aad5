"""Cross-device ops against an exact float64 reference, and model.fit with each op."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_distrib as td
from tf_distrib.cross_device import (
    BucketedAllReduce,
    CastCompressor,
    CompressedAllReduce,
    RingAllReduce,
)
from tf_distrib.datasets import build_model, make_data
from tf_distrib.testing import run_workers

OPS = {
    "ring": (RingAllReduce, 0.0),
    "bucketed": (lambda: BucketedAllReduce(bucket_bytes=256), 0.0),
    "bucketed+ring": (lambda: BucketedAllReduce(256, inner=RingAllReduce()), 0.0),
    "bf16": (lambda: CompressedAllReduce("bfloat16"), 2.0 ** -8),
    "fp16": (lambda: CompressedAllReduce("float16"), 2.0 ** -11),
    "bf16+bucketed+ring": (lambda: CompressedAllReduce(
        "bfloat16", inner=BucketedAllReduce(256, inner=RingAllReduce())), 2.0 ** -8),
}
# Precision of each dtype's own arithmetic (inputs are summed in it).
EPS = {tf.float64: 1e-13, tf.float32: 2.0 ** -23, tf.float16: 2.0 ** -10,
       tf.bfloat16: 2.0 ** -7, tf.int32: 0.0}
DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32)


def devices(n):
    return [d.name for d in tf.config.list_logical_devices("CPU")][:n]


def replica_arrays(n, seed=0):
    """Per replica: one value of each dtype (various shapes) and a sparse gradient."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dense = [rng.standard_normal((5, 3)) * 10, rng.standard_normal(17) * 1e3,
                 rng.standard_normal((2, 2, 2)), rng.standard_normal(4),
                 rng.integers(-50, 50, (3, 3))]
        sparse = (rng.standard_normal((3, 4)), rng.integers(0, 6, 3))  # values, indices
        out.append((dense, sparse))
    return out


def to_tf(dense, sparse):
    tensors = [tf.constant(a, dtype=d) for a, d in zip(dense, DTYPES, strict=True)]
    tensors.append(tf.IndexedSlices(tf.constant(sparse[0], tf.float32),
                                    tf.constant(sparse[1], tf.int64),
                                    tf.constant([6, 4], tf.int64)))
    return tensors


def reference(arrays, reduce_op):
    n = len(arrays)
    dense = [sum(np.asarray(a[0][i], np.float64) for a in arrays) for i in range(len(DTYPES))]
    sparse, sparse_magnitude = np.zeros((6, 4)), np.zeros((6, 4))
    for _, (values, indices) in arrays:
        np.add.at(sparse, indices, values)
        np.add.at(sparse_magnitude, indices, np.abs(values))
    if reduce_op == "MEAN":
        dense = [d / n for d in dense]
        sparse /= n
    return dense + [sparse], [sum(np.abs(np.asarray(a[0][i], np.float64)) for a in arrays)
                              for i in range(len(DTYPES))] + [sparse_magnitude]


def check(result, expected, magnitude, dtype, compression_eps, n, strategy):
    for component in strategy.experimental_local_results(result):
        got = np.asarray(tf.convert_to_tensor(component), np.float64)
        if dtype == tf.int32:
            np.testing.assert_array_equal(got, expected)  # integers are never compressed
            continue
        eps = max(EPS.get(dtype, 2.0 ** -23), compression_eps if dtype.size > 2 else 0.0)
        bound = (n + 1) * eps * magnitude + 1e-6
        assert np.all(np.abs(got - expected) <= bound), (dtype, np.abs(got - expected).max())


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("reduce_op", ["SUM", "MEAN"])
def test_batch_reduce_matches_float64_reference(name, replicas, reduce_op):
    make_op, compression_eps = OPS[name]
    strategy = tf.distribute.MirroredStrategy(devices(replicas), cross_device_ops=make_op())
    arrays = replica_arrays(replicas)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: to_tf(*arrays[ctx.replica_id_in_sync_group]))
    expected, magnitudes = reference(arrays, reduce_op)
    # TF reduces int32 on the host, never through a custom op, and refuses to mix it
    # with device values in one batch: it gets a call of its own.
    floating = [v for v, d in zip(values, [*DTYPES, tf.float32], strict=True) if d != tf.int32]
    reduced = strategy.extended.batch_reduce_to(reduce_op, [(v, v) for v in floating])
    reduced.insert(DTYPES.index(tf.int32), strategy.extended.reduce_to(
        reduce_op, values[DTYPES.index(tf.int32)], values[DTYPES.index(tf.int32)]))
    for r, e, m, d in zip(reduced, expected, magnitudes, [*DTYPES, tf.float32], strict=True):
        if d == tf.int32 and reduce_op == "MEAN":
            continue  # TF's own integer mean (truncating); not this op's business
        check(r, e, m, d, compression_eps, replicas, strategy)
    # Empty batches (TF's own MirroredStrategy.batch_reduce_to([]) crashes before
    # reaching the op, so the op is asked directly).
    assert make_op().batch_reduce_implementation(reduce_op, [], None) == []


@pytest.mark.parametrize("name", OPS)
def test_all_reduce_in_a_function_reduce_and_gather(name):
    """The paths model.fit, strategy.reduce and strategy.gather take."""
    make_op, compression_eps = OPS[name]
    strategy = tf.distribute.MirroredStrategy(devices(4), cross_device_ops=make_op())
    arrays = replica_arrays(4, seed=1)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: to_tf(*arrays[ctx.replica_id_in_sync_group])[:2])

    @tf.function
    def all_reduce(values):
        return strategy.run(lambda *v: tf.distribute.get_replica_context().all_reduce(
            "SUM", list(v)), args=tuple(values))

    expected, magnitudes = reference(arrays, "SUM")
    for r, e, m, d in zip(all_reduce(values), expected[:2], magnitudes[:2], DTYPES[:2],
                          strict=True):
        check(r, e, m, d, compression_eps, 4, strategy)
    total = strategy.reduce("SUM", values[0], axis=None)
    assert np.allclose(total, expected[0], rtol=1e-2 if compression_eps else 1e-6)
    gathered = strategy.gather(values[0], axis=0)
    np.testing.assert_allclose(gathered, np.concatenate([a[0][0] for a in arrays]), rtol=1e-6)


@pytest.mark.parametrize("dtype, inner", [("bfloat16", None), ("float16", None),
                                          ("bfloat16", RingAllReduce()),
                                          ("bfloat16", BucketedAllReduce(256))])
def test_compression_really_rounds_what_it_sends(dtype, inner):
    # 1 + 2^-12 is no bfloat16 (nor, halved, a float16): an op that skipped compression
    # would return 2 + 2^-11, one that compressed returns exactly 2.
    strategy = tf.distribute.MirroredStrategy(
        devices(2), cross_device_ops=CompressedAllReduce(dtype, inner=inner))
    x = 1.0 + 2.0 ** -12
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([300], tf.constant(x, tf.float32)))
    [reduced] = strategy.extended.batch_reduce_to("SUM", [(values, values)])
    for component in strategy.experimental_local_results(reduced):
        np.testing.assert_array_equal(component, np.full(300, 2.0, np.float32))
    assert np.float32(x) + np.float32(x) != np.float32(2.0)


def fit_loss(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
    dataset = td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices(make_data(1024)), 64)
    return model.fit(dataset, epochs=2, verbose=0).history["loss"][-1]


def test_fit_with_each_op_converges_like_the_default():
    default = fit_loss(td.make_strategy())
    for name, (make_op, compression_eps) in OPS.items():
        loss = fit_loss(tf.distribute.MirroredStrategy(devices(4), cross_device_ops=make_op()))
        # fp32 ops: the same training up to summation order; 16-bit: documented tolerance.
        tolerance = 0.25 * default if compression_eps else 1e-4 + 1e-3 * default
        assert abs(loss - default) <= tolerance, (name, loss, default)
    for kwargs in ({"compression": "bf16"}, {"bucket_bytes": 1024},
                   {"compression": "fp16", "bucket_bytes": 1024}):
        strategy = td.make_strategy(**kwargs)
        assert abs(fit_loss(strategy) - default) <= 0.25 * default, kwargs


def compressed_mwms_job(compression, bucket_bytes, transport):
    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import build_model, make_data

    keras.utils.set_random_seed(0)
    strategy = td.make_strategy(compression=compression, bucket_bytes=bucket_bytes,
                                transport=transport)
    with strategy.scope():
        model = build_model()
    dataset = td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices(make_data(1024)), 64)
    history = model.fit(dataset, epochs=2, verbose=0)
    return {"loss": history.history["loss"], "weights": [w.numpy() for w in model.weights],
            "sent": gradient_collectives(strategy, model),
            "mode": getattr(strategy.transport, "mode", None)}


def gradient_collectives(strategy, model):
    """(dtype, elements) of each collective the gradient path issues, in launch order.

    TF's collective is a CollectiveReduceV2 op per bucket (its first input); tf_distrib's
    transport one op per bucket (a numpy_function, or on one host the native op, after the
    collective's number), or across hosts a start per bucket (its finish has no tensor
    input).
    """
    import tensorflow as tf

    from tf_distrib.cross_device import gradients

    reduce = gradients.of_strategy(strategy)
    if reduce is None:
        return None
    step = tf.function(lambda: strategy.run(
        lambda: reduce([tf.identity(w) for w in model.trainable_weights])))
    sent = []
    for op in step.get_concrete_function().graph.get_operations():
        if op.type == "CollectiveReduceV2" or (op.name.startswith("tf_distrib_all_reduce")
                                               and "finish" not in op.name):
            tensors = op.inputs[:1] if op.type == "CollectiveReduceV2" else op.inputs[1:]
            sent.append((tensors[0].dtype.name, sum(t.shape.num_elements() for t in tensors)))
    return sent


@pytest.mark.multiprocess
def test_mwms_gradient_compression_keeps_workers_in_sync():
    runs = {args: [w.value for w in run_workers(compressed_mwms_job, 2, args=args,
                                                 quiet=True, timeout=240)]
            for args in ((None, None, "tf"), ("bf16", 4096, "tf"), ("fp16", None, "tf"),
                         (None, None, "auto"), ("bf16", 4096, "tcp"))}
    default = runs[(None, None, "tf")][0]["loss"][-1]
    for args, (a, b) in runs.items():
        # Workers that stopped synchronising would diverge here.
        for wa, wb in zip(a["weights"], b["weights"], strict=True):
            np.testing.assert_array_equal(wa, wb)
        assert a["loss"] == b["loss"]
        assert abs(a["loss"][-1] - default) <= 0.25 * default, args
    # Compression changed the arithmetic: the hook really ran.
    assert runs[("bf16", 4096, "tf")][0]["loss"] != runs[(None, None, "tf")][0]["loss"]
    # tf_distrib's transport: shared memory on one host; the TCP ring where asked for (its
    # collectives overlap: each bucket started in order, all finished after).
    assert runs[("bf16", 4096, "tcp")][0]["mode"] == "tcp"
    assert runs[(None, None, "auto")][0]["mode"] == "shm"
    # One collective per bucket, the last layer's first (weights 1024, 64, 4096, 64, 256, 4
    # floats; 4096-byte buckets); without bucket_bytes the small gradients share one.
    for transport in ("tf", "tcp"):
        assert runs[("bf16", 4096, transport)][0]["sent"] == [
            ("bfloat16", 324), ("bfloat16", 4096), ("bfloat16", 64), ("bfloat16", 1024)]
    assert runs[("fp16", None, "tf")][0]["sent"] == [("float16", 5508)]
    assert runs[(None, None, "auto")][0]["sent"] == [("float32", 5508)]
    assert runs[(None, None, "tf")][0]["sent"] is None  # Keras' own all-reduce
    # The transport sums in another order than TF's ring: fp32 round-off apart.
    np.testing.assert_allclose(runs[(None, None, "auto")][0]["loss"],
                               runs[(None, None, "tf")][0]["loss"], rtol=1e-4)


def test_compressors_round_trip_within_their_bounds():
    x = tf.constant(np.random.default_rng(2).standard_normal(1000) * 100, tf.float32)
    for dtype in ("bfloat16", "float16"):
        compressor = CastCompressor(dtype)
        compressed, ctx = compressor.compress(x)
        assert compressed.dtype == tf.as_dtype(dtype)
        back = compressor.decompress(compressed, ctx)
        assert back.dtype == tf.float32
        assert np.all(np.abs(back - x) <= compressor.relative_error * np.abs(x) + 1e-30)
    huge, ctx = CastCompressor("float16").compress(tf.constant([1e6, -1e6, 3.0]))
    np.testing.assert_array_equal(huge.numpy(), [65504, -65504, 3])  # saturates, no inf
    ints, ctx = CastCompressor("bfloat16").compress(tf.constant([1, 2]))
    assert ints.dtype == tf.int32 and ctx is None


def test_buckets_are_consecutive_last_layer_first():
    from tf_distrib.cross_device.bucketing import plan_buckets

    tensors = [tf.zeros([100]), tf.zeros([10]), tf.zeros([10], tf.float16),
               tf.zeros([10], tf.float16), tf.zeros([300]), tf.zeros([5])]
    # 400-byte buckets: one dtype each; a 1200-byte tensor travels alone.
    assert plan_buckets(tensors, 400) == [[5], [4], [2, 3], [1], [0]]
    assert plan_buckets(tensors, 2000) == [[4, 5], [2, 3], [0, 1]]
    # 68 bytes each: 136 packed back to back, 256 with each on its own 64-byte line.
    odd = [tf.zeros([17]), tf.zeros([17])]
    assert plan_buckets(odd, 136) == [[0, 1]]
    assert plan_buckets(odd, 136, align=64) == [[1], [0]]
    # On one host (MirroredStrategy) large tensors travel alone, and the small ones
    # around them share a bucket: weights 1200 bytes, biases 40 and 20.
    layers = [tf.zeros([300]), tf.zeros([10]), tf.zeros([300]), tf.zeros([5])]
    assert plan_buckets(layers, 2000, alone_from_bytes=400) == [[2], [1, 3], [0]]
    # Across hosts the first bucket closes once it holds 1000 bytes (DDP's 1 MiB, scaled):
    # the last layer's weights travel while backward computes the first's.
    assert plan_buckets(layers, 2000, first_bucket_bytes=1000) == [[2, 3], [0, 1]]
    assert plan_buckets(layers, 2000, first_bucket_bytes=10) == [[3], [1, 2], [0]]


def test_compressor_casts_are_bitwise_tf_cast(caplog):
    # XLA compiles the casts of dense tensors; they must round exactly as tf.cast does.
    rng = np.random.default_rng(3)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1.0 + 2.0 ** -8,
               1.0 + 3 * 2.0 ** -8, 65504.0, 65519.0, 3.4e38]  # ties, denormals, edges
    x = tf.constant(np.concatenate([rng.standard_normal(10_000) * 1e3, special]), tf.float32)
    for dtype in (tf.bfloat16, tf.float16):
        compressor = CastCompressor(dtype.name)
        clipped = tf.clip_by_value(x, -65504, 65504) if dtype == tf.float16 else x
        compressed, ctx = compressor.compress(x)
        np.testing.assert_array_equal(tf.bitcast(compressed, tf.uint16),
                                      tf.bitcast(tf.cast(clipped, dtype), tf.uint16))
        np.testing.assert_array_equal(tf.bitcast(compressor.decompress(compressed, ctx),
                                                 tf.uint32),
                                      tf.bitcast(tf.cast(compressed, tf.float32), tf.uint32))
    # A model's many gradient shapes share one trace: TF warns about retracing otherwise.
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        for n in range(1, 9):
            CastCompressor("bfloat16").compress(tf.ones([n, 3]))
    assert "retracing" not in caplog.text
    # Shapes known only at run time (IndexedSlices values) keep TF's own kernel.
    unknown = tf.function(lambda t: CastCompressor("bfloat16").compress(t)[0],
                          input_signature=[tf.TensorSpec([None], tf.float32)])
    np.testing.assert_array_equal(unknown(x[:100]), tf.cast(x[:100], tf.bfloat16))


@pytest.mark.parametrize("make, error, message", [
    (lambda: CompressedAllReduce("int8"), ValueError, "compression must be one of"),
    (lambda: BucketedAllReduce(0), ValueError, "bucket_bytes must be an integer >= 1"),
    (lambda: RingAllReduce.__mro__[1](inner="nccl"), TypeError, "inner must be"),
    (lambda: td.make_strategy(compression="zip"), ValueError, "compression must be one of"),
    (lambda: td.make_strategy(bucket_bytes=-5), ValueError, "bucket_bytes"),
])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()
