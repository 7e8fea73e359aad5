"""The gradient all-reduce of MultiWorkerMirroredStrategy: buckets, compression, transport.

MWMS asserts that its cross-device op is TF's CollectiveAllReduce, and swapping it
silently stops cross-worker synchronisation. Keras 3 sums gradients in one place,
`TFOptimizer._all_reduce_sum_gradients`, through `replica_context.all_reduce`;
`tf_distrib.strategy.optimizer_hooks` routes that call through the `GradientAllReduce` of a
strategy from `make_strategy()`. Metrics and logged losses are never compressed: they
go through the strategy's own `reduce`.

One reduction path for every setting: gradients go in buckets of consecutive
gradients, last layer first (`bucketing.plan_buckets`); each bucket is encoded
(`compression.encode_for_sum`: prescale, compress), summed by one collective, and
decoded. The collective is tf_distrib's transport when the strategy has one (shared
memory or a TCP ring: `tf_distrib.transport`), else TensorFlow's.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib._checks import check_int
from tf_distrib.cross_device import bucketing
from tf_distrib.cross_device.compression import (
    Compressor,
    NoCompression,
    decode_sum,
    encode_for_sum,
    get_compressor,
)
from tf_distrib.cross_device.powersgd import PowerSGD, PowerSGDAllReduce
from tf_distrib.transport import buffers, graph_op
from tf_distrib.transport.sgd_step import SgdStep

SUM = tf.distribute.ReduceOp.SUM
# Attribute of a strategy made by make_strategy(): its GradientAllReduce, or None.
ATTRIBUTE = "_tf_distrib_gradients"


def of_strategy(strategy: tf.distribute.Strategy):
    """The `GradientAllReduce` of a strategy from `make_strategy()`, or None."""
    return getattr(strategy, ATTRIBUTE, None)


def state_owner(optimizer):
    """The optimizer whose gradients a model's all-reduce sums: a wrapper's (Keras'
    `LossScaleOptimizer`) inner one, which Keras' apply step runs."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


class GradientAllReduce:
    """Sums gradients across all replicas: in buckets, compressed, by one collective each.

    Args:
        compression: "bf16", "fp16", "powersgd", "none", a `Compressor` or a
            `PowerSGD` (which needs `transport`). Defaults to None (none).
        bucket_bytes: Largest bucket of consecutive gradients, in bytes (a larger
            gradient travels alone). Defaults to None: 25 MiB, PyTorch DDP's default,
            or on one host the largest bucket the transport sums in place in shared
            memory (`Transport.in_place_bytes`, 16 MiB where /dev/shm has room) if that
            is smaller; across hosts (a transport that `overlaps`) a first bucket that
            closes once it holds 1 MiB, as DDP's does: its sum travels while backward
            computes the rest. A value given here is the only limit.
        transport: A `tf_distrib.transport.Transport` to carry dense buckets. Defaults
            to None: TensorFlow's collective (then each bucket is packed into one tensor).
    """

    def __init__(self, compression: str | Compressor | PowerSGD | None = None,
                 bucket_bytes: int | None = None, transport=None):
        if compression == "powersgd":
            compression = PowerSGD()
        self.powersgd = None
        if isinstance(compression, PowerSGD):
            # Checked by make_strategy before it connects a transport.
            self.powersgd = None if transport is None else PowerSGDAllReduce(compression,
                                                                             transport)
            compression = None
        self.compressor = get_compressor(compression)
        self._first_bucket_bytes = bucketing.FIRST_BUCKET_BYTES if bucket_bytes is None else None
        if bucket_bytes is None:
            bucket_bytes = bucketing.DEFAULT_BUCKET_BYTES
            if transport is not None and transport.in_place_bytes:
                bucket_bytes = min(bucket_bytes, transport.in_place_bytes)
        self.bucket_bytes = check_int("bucket_bytes", bucket_bytes)
        self.transport = transport

    def worker_state(self, owner=None) -> dict:
        """What `BackupAndRestore` saves of each worker besides the model: PowerSGD's,
        of `owner` (the model's optimizer: see `__call__`)."""
        return {} if self.powersgd is None else self.powersgd.worker_state(owner)

    def load_worker_state(self, rows: dict, row: int, owner=None) -> None:
        """Restores `worker_state` from every worker's saved rows (see PowerSGD's)."""
        if self.powersgd is not None:
            self.powersgd.load_worker_state(rows, row, owner)

    def sgd(self, step: SgdStep, grads: list, owner=None) -> bool:
        """Keras' SGD step fused into the all-reduce, where it can be: the transport's
        native op sums the gradients, each worker updates only its part of the weights
        (and velocities), and the op assigns the variables bitwise what `__call__` and
        Keras' update would give. Dense float32 gradients and variables, no compression
        but PowerSGD's, whose native ops take the step while they rebuild the sums
        (`PowerSGDAllReduce.sgd`).

        Args:
            step: Keras' step: its learning rate, variables (one per gradient) and
                momentum.
            grads: The replica's gradients.
            owner: As `__call__`'s.

        Returns:
            Whether the step ran (assigning the variables); False where this all-reduce
            cannot fuse it, and nothing ran.
        """
        if self.transport is None or any(
                isinstance(t, tf.IndexedSlices) or t.dtype != tf.float32
                for t in (*grads, *step.variables, *(step.velocities or ()))):
            return False
        if self.powersgd is not None:
            if self.transport.op_library is None:
                return False
            self.powersgd.sgd(step, list(grads), owner)
            return True
        if self.transport.native is None or not isinstance(self.compressor, NoCompression):
            return False
        graph_op.sgd(self.transport, step, grads)
        return True

    def __call__(self, grads: list, owner=None) -> list:
        """All-reduces `grads` (SUM) in replica context; same structure out.

        `IndexedSlices` (embedding gradients) go through TensorFlow's collective.

        Args:
            grads: The replica's gradients.
            owner: Whose PowerSGD state they use: the optimizer (`state_owner`), so that
                each model has its own. Defaults to None: this all-reduce's own.
        """
        context = tf.distribute.get_replica_context()
        n = context.num_replicas_in_sync
        results = list(grads)
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        if sparse:
            for i, g in zip(sparse, context.all_reduce(SUM, [grads[i] for i in sparse]),
                            strict=True):
                results[i] = g
        if self.powersgd is not None and dense:
            float32 = [i for i in dense if grads[i].dtype == tf.float32]
            dense = [i for i in dense if grads[i].dtype != tf.float32]
            if float32:
                for i, g in zip(float32, self.powersgd([grads[i] for i in float32], owner),
                                strict=True):
                    results[i] = g
        values = [grads[i] for i in dense]
        if not values:
            return results
        # Buckets go last layer first, the order backward computes them in: TF launches
        # one device's collectives in call order, and the transport chains them so.
        # Across hosts a small first bucket gives the network work early (DDP's schedule).
        overlaps = self.transport is not None and self.transport.overlaps
        plan = bucketing.plan_buckets(
            values, self.bucket_bytes,
            first_bucket_bytes=self._first_bucket_bytes if overlaps else None,
            align=buffers.ALIGN if self.transport is not None else 1)
        if self.transport is not None:
            encoded = [[encode_for_sum(self.compressor, values[k], n) for k in members]
                       for members in plan]
            summed = graph_op.all_reduce_buckets(self.transport,
                                                 [[w for w, _ in bucket] for bucket in encoded])
            for members, bucket, sums in zip(plan, encoded, summed, strict=True):
                for k, (_, ctx), s in zip(members, bucket, sums, strict=True):
                    results[dense[k]] = decode_sum(self.compressor, s, ctx, n)
            return results
        for members in plan:
            bucket = [values[k] for k in members]
            # TF's batch all-reduce packs every tensor of a call into one collective
            # anyway; one call per bucket lets each travel as soon as it exists.
            wire, ctx = encode_for_sum(self.compressor, bucketing.pack(bucket), n)
            flat = context.all_reduce(SUM, wire)
            reduced = bucketing.unpack(decode_sum(self.compressor, flat, ctx, n), bucket)
            for k, part in zip(members, reduced, strict=True):
                results[dense[k]] = part
        return results
