"""Pack many tensors into a few flat buckets and back (tensor fusion).

Reducing one 25 MB bucket costs one collective's fixed overhead instead of hundreds:
on 4 logical CPUs TF's ops spend ~0.25 ms per tensor whatever its size (`make bench`).
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib._checks import check_int

__all__ = ["DEFAULT_BUCKET_BYTES", "ALONE_FROM_BYTES", "plan_buckets", "plan_backward_buckets",
           "pack", "unpack"]

# PyTorch DDP's default bucket size.
DEFAULT_BUCKET_BYTES = 25 * 2**20
# Tensors this large travel alone: copying them into a bucket costs more than the
# per-op overhead it saves (~25 us per op against ~5 GB/s of copying: ~128 KB break-even,
# measured on CPU with `make bench` -> allreduce).
ALONE_FROM_BYTES = 2**17


def plan_buckets(tensors, bucket_bytes: int,
                 alone_from_bytes: int = ALONE_FROM_BYTES) -> list[list[int]]:
    """Groups tensor indices into buckets of one dtype and at most `bucket_bytes` each.

    Tensors keep their order inside a bucket; one of `alone_from_bytes` or more (or
    larger than `bucket_bytes`) gets a bucket of its own, which packs without a copy.
    """
    check_int("bucket_bytes", bucket_bytes)
    open_buckets: dict[tf.DType, tuple[list[int], int]] = {}
    buckets = []
    for i, t in enumerate(tensors):
        nbytes = _nbytes(t)
        if nbytes >= alone_from_bytes:
            buckets.append([i])
            continue
        members, used = open_buckets.get(t.dtype, ([], 0))
        if members and used + nbytes > bucket_bytes:
            buckets.append(members)
            members, used = [], 0
        open_buckets[t.dtype] = (members + [i], used + nbytes)
    buckets += [members for members, _ in open_buckets.values() if members]
    return sorted(buckets, key=lambda b: b[0])


def plan_backward_buckets(tensors, bucket_bytes: int) -> list[list[int]]:
    """Buckets of consecutive tensor indices, last tensor first (PyTorch DDP's order).

    Backward computes gradients from the last layer to the first, so the first bucket
    is ready first and can travel while backward goes on. A bucket holds one dtype
    and at most `bucket_bytes`, unless one tensor alone is larger. Indices in each
    bucket are ascending (the order `pack` expects).
    """
    check_int("bucket_bytes", bucket_bytes)
    buckets, members, used, dtype = [], [], 0, None
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        if members and (t.dtype != dtype or used + _nbytes(t) > bucket_bytes):
            buckets.append(members[::-1])
            members, used = [], 0
        members.append(i)
        used += _nbytes(t)
        dtype = t.dtype
    if members:
        buckets.append(members[::-1])
    return buckets


def pack(tensors) -> tf.Tensor:
    """Concatenates the tensors, flattened, into one 1-D tensor."""
    flat = [_flatten(t) for t in tensors]
    return flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)


def unpack(flat: tf.Tensor, like) -> list[tf.Tensor]:
    """Splits `flat` back into tensors shaped like `like` (the tensors given to `pack`)."""
    if len(like) == 1:
        return [_shape_like(flat, like[0])]
    sizes = [t.shape.num_elements() if t.shape.is_fully_defined() else tf.size(t) for t in like]
    parts = tf.split(flat, sizes)
    return [_shape_like(p, t) for p, t in zip(parts, like, strict=True)]


def _nbytes(tensor) -> int:
    """Bytes of `tensor`; 0 when its shape is not fully known."""
    size = tensor.shape.num_elements()
    return (size or 0) * tensor.dtype.size


# Each graph op costs ~25 us on CPU whatever its size, and buckets exist to save ops:
# known 1-D shapes need no reshape, known shapes no Shape op.
def _flatten(tensor):
    return tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])


def _shape_like(part, like):
    if like.shape.rank == 1 and like.shape.is_fully_defined():
        return part
    return tf.reshape(part, like.shape if like.shape.is_fully_defined() else tf.shape(like))
