"""Compression and buckets on Keras' gradient all-reduce under MultiWorkerMirroredStrategy.

MWMS asserts that its cross-device op is TF's CollectiveAllReduce, and swapping it
silently stops cross-worker synchronisation. Keras 3 sums gradients in one place,
`TFOptimizer._all_reduce_sum_gradients`, through `replica_context.all_reduce`; this
module routes that call through a `GradientAllReduce` when the optimizer's strategy
carries one (only strategies from `make_strategy(compression=..., bucket_bytes=...)`).
Metrics and logged losses keep their exact float32 reductions.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib._checks import check_int
from tf_distrib.cross_device import bucketing
from tf_distrib.cross_device.compression import Compressor, get_compressor

# Attribute of a strategy holding its GradientAllReduce.
STRATEGY_ATTRIBUTE = "_tf_distrib_gradient_all_reduce"


class GradientAllReduce:
    """Sums gradients across all replicas: compressed, packed in buckets, by TF's collective.

    Args:
        compression: "bf16", "fp16", "none" or a `Compressor`. Defaults to None (none).
        bucket_bytes: Largest bucket of consecutive gradients, in bytes (a larger
            gradient travels alone). Defaults to None: 25 MiB, PyTorch DDP's default.
    """

    def __init__(self, compression: str | Compressor | None = None,
                 bucket_bytes: int | None = None):
        self.compressor = get_compressor(compression)
        self.bucket_bytes = (bucketing.DEFAULT_BUCKET_BYTES if bucket_bytes is None
                             else check_int("bucket_bytes", bucket_bytes))

    def __call__(self, grads: list) -> list:
        """All-reduces `grads` (SUM) in replica context; same structure out."""
        context = tf.distribute.get_replica_context()
        results = list(grads)
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        if sparse:
            for i, g in zip(sparse, context.all_reduce(tf.distribute.ReduceOp.SUM,
                                                       [grads[i] for i in sparse]), strict=True):
                results[i] = g
        if not dense:
            return results
        values = [grads[i] for i in dense]
        # TF's batch all-reduce concatenates every tensor of one call into a single
        # collective (`bytes_per_pack=0`), so each bucket gets a call of its own: no
        # extra copy, and a bucket can travel as soon as its gradients exist. Buckets
        # go last layer first, the order backward computes them in, because TF launches
        # the collectives of one device in call order.
        plan = bucketing.plan_backward_buckets(values, self.bucket_bytes)
        for members in plan:
            reduced = self._reduce_bucket(context, [values[k] for k in members])
            for k, part in zip(members, reduced, strict=True):
                results[dense[k]] = part
        return results

    def _reduce_bucket(self, context, tensors: list) -> list:
        """Packs, compresses, sums across replicas and unpacks one bucket."""
        n = context.num_replicas_in_sync
        # With float16 each replica sends g / n so the sum stays in range.
        prescale = self.compressor.prescale and tensors[0].dtype.is_floating
        flat = bucketing.pack(tensors)
        if prescale:
            flat = flat * tf.cast(1.0 / n, flat.dtype)
        flat, ctx = self.compressor.compress(flat)
        flat = context.all_reduce(tf.distribute.ReduceOp.SUM, flat)
        flat = self.compressor.decompress(flat, ctx)
        if prescale:
            flat = flat * tf.cast(n, flat.dtype)
        return bucketing.unpack(flat, tensors)


def install() -> None:
    """Routes Keras' gradient all-reduce through a strategy's GradientAllReduce. Idempotent."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    original = TFOptimizer._all_reduce_sum_gradients
    if getattr(original, "_tf_distrib", False):
        return

    def all_reduce_sum_gradients(self, grads_and_vars):
        reduce = getattr(self._distribution_strategy, STRATEGY_ATTRIBUTE, None)
        if reduce is None or not tf.distribute.get_replica_context():
            return original(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
        reduced = reduce([grads_and_vars[i][0] for i in present]) if present else []
        result = list(grads_and_vars)
        for i, g in zip(present, reduced, strict=True):
            result[i] = (g, grads_and_vars[i][1])
        return result

    all_reduce_sum_gradients._tf_distrib = True
    TFOptimizer._all_reduce_sum_gradients = all_reduce_sum_gradients
