"""Pack many tensors into a few flat buckets and back (tensor fusion).

Reducing one 25 MB bucket costs one collective's fixed overhead instead of hundreds:
on 4 logical CPUs TF's ops spend ~0.25 ms per tensor whatever its size (`make bench`).
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib._checks import check_int

__all__ = ["DEFAULT_BUCKET_BYTES", "FIRST_BUCKET_BYTES", "ALONE_FROM_BYTES", "plan_buckets",
           "pack", "unpack"]

# PyTorch DDP's default bucket size.
DEFAULT_BUCKET_BYTES = 25 * 2**20
# PyTorch DDP's first bucket: it closes once it holds this much, so that the network
# gets work early in the backward pass.
FIRST_BUCKET_BYTES = 2**20
# On one host (MirroredStrategy), tensors this large travel alone: copying them into a
# bucket costs more than the per-op overhead it saves (~25 us per op against ~5 GB/s of
# copying: ~128 KB break-even, measured on CPU with `make bench` -> allreduce).
ALONE_FROM_BYTES = 2**17


def plan_buckets(tensors, bucket_bytes: int, alone_from_bytes: int | None = None,
                 first_bucket_bytes: int | None = None, align: int = 1) -> list[list[int]]:
    """Groups tensor indices into buckets, in the order backward computes the tensors.

    Walking from the last tensor to the first (backward computes the last layer's
    gradients first: PyTorch DDP's order), tensors join the open bucket until it would
    exceed `bucket_bytes` or the dtype changes, which starts a new one. A tensor of
    `alone_from_bytes` or more, when given, travels in a bucket of its own and leaves
    the open bucket open. Buckets come out in the order they are complete (the first
    can travel while backward goes on); indices inside a bucket are ascending, the
    order `pack` expects.

    Example, the benchmark MLP (W1 3.2 MB, b1, W2 4.2 MB, b2, W3 41 KB, b3) with 25 MiB
    buckets: one bucket, `[[0, 1, 2, 3, 4, 5]]`; with a 1 MiB first bucket as well:
    `[[2, 3, 4, 5], [0, 1]]` (W2's sum can travel while backward computes W1's).

    Args:
        tensors: Anything with `.shape` and `.dtype`.
        bucket_bytes: The largest bucket, in bytes; one larger tensor fills one alone.
        alone_from_bytes: Tensors of this many bytes or more travel alone. Defaults to
            None: every tensor joins the open bucket.
        first_bucket_bytes: The first bucket closes as soon as it holds this many bytes
            or more. Defaults to None: like the others.
        align: Each tensor counts as its bytes rounded up to a multiple of this, the
            padding of a layout that starts every tensor on an aligned boundary (the
            transport's `Layout`). Defaults to 1: packed back to back.
    """
    check_int("bucket_bytes", bucket_bytes)
    buckets, members, used = [], [], 0
    for i in reversed(range(len(tensors))):
        nbytes = -(-_nbytes(tensors[i]) // align) * align
        if alone_from_bytes is not None and nbytes >= alone_from_bytes:
            buckets.append([i])
            continue
        if members and (used + nbytes > bucket_bytes
                        or tensors[i].dtype != tensors[members[0]].dtype):
            buckets.append(members)
            members, used = [], 0
        members.append(i)
        used += nbytes
        if not buckets and first_bucket_bytes is not None and used >= first_bucket_bytes:
            buckets.append(members)
            members, used = [], 0
    if members:
        buckets.append(members)
    # Complete once their lowest index (the last one backward computes) exists.
    return sorted((sorted(b) for b in buckets), key=lambda b: -b[0])


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
