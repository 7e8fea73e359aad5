"""`tf.distribute.CrossDeviceOps` for MirroredStrategy: compressed, bucketed, ring.

They compose, each reducing what `model.fit`'s gradient all-reduce passes and handing
everything else to its `inner` op (NCCL on GPUs, `ReductionToOneDevice` on CPUs).

Example:

```python
strategy = tf.distribute.MirroredStrategy(
    cross_device_ops=td.cross_device.CompressedAllReduce("bfloat16",
        inner=td.cross_device.BucketedAllReduce()))
```
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib import _compat
from tf_distrib._checks import check_int
from tf_distrib.cross_device import bucketing
from tf_distrib.cross_device.compression import (
    Compressor,
    decode_sum,
    encode_for_sum,
    get_compressor,
    scale,
)

__all__ = ["CompressedAllReduce", "BucketedAllReduce", "RingAllReduce"]


def _default_inner(devices) -> tf.distribute.CrossDeviceOps:
    if any("GPU" in d.upper() for d in devices):
        return tf.distribute.NcclAllReduce()
    return tf.distribute.ReductionToOneDevice()


class _LocalReduce(tf.distribute.CrossDeviceOps):
    """Shared plumbing: split a batch into what this op reduces and what `inner` does."""

    def __init__(self, inner: tf.distribute.CrossDeviceOps | None = None):
        super().__init__()
        if inner is not None and not isinstance(inner, tf.distribute.CrossDeviceOps):
            raise TypeError(f"inner must be a tf.distribute.CrossDeviceOps, got "
                            f"{type(inner).__name__}.")
        self._inner = inner

    def inner(self, devices) -> tf.distribute.CrossDeviceOps:
        """The op that reduces what this one does not; chosen from `devices` if unset."""
        if self._inner is None:
            self._inner = _default_inner(devices)
        return self._inner

    def _handles(self, value) -> bool:
        """Whether this op reduces `value` itself (given local destinations)."""
        return True

    def _reduce_local(self, reduce_op, values, devices, options):
        """Reduces PerReplica `values` living on `devices` to Mirrored values there."""
        raise NotImplementedError

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self.batch_reduce_implementation(
            reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        if not value_destination_pairs:
            return []
        results = [None] * len(value_destination_pairs)
        local, delegated = [], []
        for i, (value, destinations) in enumerate(value_destination_pairs):
            devices = _canonical(_compat.devices_of(destinations))
            own = _canonical(v.device for v in value.values)
            if devices == own and len(own) > 1 and self._handles(value.values[0]):
                local.append(i)
            else:
                delegated.append(i)
        if local:
            devices = _canonical(v.device for v in value_destination_pairs[local[0]][0].values)
            reduced = self._reduce_local(
                reduce_op, [value_destination_pairs[i][0] for i in local], devices, options)
            for i, r in zip(local, reduced, strict=True):
                results[i] = r
        if delegated:
            pairs = [value_destination_pairs[i] for i in delegated]
            devices = _compat.devices_of(pairs[0][1])
            reduced = self.inner(devices).batch_reduce_implementation(reduce_op, pairs, options)
            for i, r in zip(delegated, reduced, strict=True):
                results[i] = r
        return results

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        devices = _compat.devices_of(destinations)
        return self.inner(devices)._gather_implementation(per_replica_value, destinations,
                                                          axis, options)


def _canonical(devices) -> tuple[str, ...]:
    return tuple(_compat.canonical_device(d) for d in devices)


def _is_dense_float(value) -> bool:
    return not isinstance(value, tf.IndexedSlices) and value.dtype.is_floating


class CompressedAllReduce(_LocalReduce):
    """Compresses floating values before `inner` reduces them, decompresses after.

    With float16 each replica sends x / N and the sum is scaled back, so the sum
    never leaves the range the inputs fit in (see `tf_distrib.cross_device.compression`
    for error bounds). Integers and narrow
    floats pass through uncompressed; `IndexedSlices` have their values compressed.

    Args:
        dtype: "bfloat16" or "float16" (or a `Compressor`). Defaults to "bfloat16".
        inner: The op that reduces the compressed values. Defaults to None: NCCL on
            GPUs, `ReductionToOneDevice` on CPUs.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy(
        cross_device_ops=td.cross_device.CompressedAllReduce("bfloat16"))
    ```
    """

    def __init__(self, dtype: str | Compressor = "bfloat16",
                 inner: tf.distribute.CrossDeviceOps | None = None):
        super().__init__(inner)
        self.compressor = get_compressor(dtype)

    def _handles(self, value) -> bool:
        values = value.values if isinstance(value, tf.IndexedSlices) else value
        return values.dtype.is_floating

    def _reduce_local(self, reduce_op, values, devices, options):
        n = len(devices)
        compressed, contexts = [], []
        for value in values:
            parts = []
            for component in value.values:
                with tf.device(component.device):
                    part, ctx = encode_for_sum(self.compressor, component, n)
                parts.append(part)
            compressed.append(_compat.per_replica(parts))
            contexts.append(ctx)
        reduced = self.inner(devices).batch_reduce_implementation(
            tf.distribute.ReduceOp.SUM, [(c, c) for c in compressed], options)
        mean = reduce_op == tf.distribute.ReduceOp.MEAN
        results = []
        for mirrored, ctx in zip(reduced, contexts, strict=True):
            parts = []
            for component in mirrored.values:
                with tf.device(component.device):
                    parts.append(decode_sum(self.compressor, component, ctx, n, mean))
            results.append(_compat.mirrored(parts))
        return results


class BucketedAllReduce(_LocalReduce):
    """Packs dense floating values into flat buckets, reduces each bucket once.

    Many small gradients cost one reduction per bucket instead of one per tensor.
    `IndexedSlices` and integers go to `inner` unpacked.

    Args:
        bucket_bytes: Largest bucket in bytes. Defaults to 25 MiB (PyTorch DDP's).
        inner: The op that reduces the buckets. Defaults to None: NCCL on GPUs,
            `ReductionToOneDevice` on CPUs.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy(
        cross_device_ops=td.cross_device.BucketedAllReduce(bucket_bytes=4 << 20))
    ```
    """

    def __init__(self, bucket_bytes: int = bucketing.DEFAULT_BUCKET_BYTES,
                 inner: tf.distribute.CrossDeviceOps | None = None):
        super().__init__(inner)
        self.bucket_bytes = check_int("bucket_bytes", bucket_bytes)

    def _handles(self, value) -> bool:
        return _is_dense_float(value)

    def _reduce_local(self, reduce_op, values, devices, options):
        plan = bucketing.plan_buckets([v.values[0] for v in values], self.bucket_bytes,
                                      alone_from_bytes=bucketing.ALONE_FROM_BYTES)
        buckets = []
        for members in plan:
            parts = []
            for r, device in enumerate(devices):
                with tf.device(device):
                    parts.append(bucketing.pack([values[i].values[r] for i in members]))
            buckets.append(_compat.per_replica(parts))
        reduced = self.inner(devices).batch_reduce_implementation(
            reduce_op, [(b, b) for b in buckets], options)
        results = [None] * len(values)
        for members, mirrored in zip(plan, reduced, strict=True):
            per_device = []
            for r, component in enumerate(mirrored.values):
                with tf.device(component.device):
                    per_device.append(bucketing.unpack(
                        component, [values[i].values[r] for i in members]))
            for k, i in enumerate(members):
                results[i] = _compat.mirrored([parts[k] for parts in per_device])
        return results


class RingAllReduce(_LocalReduce):
    """Ring all-reduce across the local devices: reduce-scatter, then all-gather.

    Each value is split into N chunks; in N-1 steps every device adds the chunk its
    neighbour sends, then in N-1 more steps the complete chunks travel round. Each
    device sends and receives 2(N-1)/N of the value, the bandwidth-optimal volume.
    Combine with `BucketedAllReduce` for many small tensors. `IndexedSlices` are
    all-gathered (their indices and values concatenated on every device).

    Args:
        inner: The op for what this one does not reduce. Defaults to None: NCCL on
            GPUs, `ReductionToOneDevice` on CPUs.

    Example:

    ```python
    ops = td.cross_device.BucketedAllReduce(inner=td.cross_device.RingAllReduce())
    strategy = tf.distribute.MirroredStrategy(cross_device_ops=ops)
    ```
    """

    def _handles(self, value) -> bool:
        return isinstance(value, tf.IndexedSlices) or value.dtype.is_floating

    def _reduce_local(self, reduce_op, values, devices, options):
        results = []
        for value in values:
            if isinstance(value.values[0], tf.IndexedSlices):
                parts = _gather_slices(value.values, devices)
            else:
                parts = _ring_sum(list(value.values), devices)
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                parts = [scale(p, 1.0 / len(devices)) for p in parts]
            results.append(_compat.mirrored(parts))
        return results


def _ring_sum(components, devices):
    n = len(devices)
    like = components[0]
    chunks = []
    for component, device in zip(components, devices, strict=True):
        with tf.device(device):
            flat = tf.reshape(component, [-1])
            pad = (-tf.size(flat)) % n
            flat = tf.pad(flat, [[0, pad]])
            chunks.append(tf.split(flat, n))
    for step in range(n - 1):  # reduce-scatter
        for i in range(n):
            dst, c = (i + 1) % n, (i - step) % n
            with tf.device(devices[dst]):
                chunks[dst][c] = chunks[dst][c] + tf.identity(chunks[i][c])
    for step in range(n - 1):  # all-gather: device i starts with complete chunk i + 1
        for i in range(n):
            dst, c = (i + 1) % n, (i + 1 - step) % n
            with tf.device(devices[dst]):
                chunks[dst][c] = tf.identity(chunks[i][c])
    results = []
    for device, parts in zip(devices, chunks, strict=True):
        with tf.device(device):
            flat = tf.concat(parts, axis=0)[:tf.size(like)]
            results.append(tf.reshape(flat, tf.shape(like)))
    return results


def _gather_slices(slices, devices):
    results = []
    for device in devices:
        with tf.device(device):
            results.append(tf.IndexedSlices(
                tf.concat([tf.identity(s.values) for s in slices], axis=0),
                tf.concat([tf.identity(s.indices) for s in slices], axis=0),
                slices[0].dense_shape))
    return results
