"""Gradient communication: compression, bucketing, ring all-reduce.

For MirroredStrategy these are `tf.distribute.CrossDeviceOps`; for
MultiWorkerMirroredStrategy (which only runs TF's collectives) the same compressors
and buckets apply to `model.fit`'s gradient all-reduce through
`make_strategy(compression=..., bucket_bytes=...)`.
"""

from tf_distrib.cross_device.bucketing import DEFAULT_BUCKET_BYTES
from tf_distrib.cross_device.compression import (
    CastCompressor,
    Compressor,
    NoCompression,
    get_compressor,
)
from tf_distrib.cross_device.ops import BucketedAllReduce, CompressedAllReduce, RingAllReduce

__all__ = ["CompressedAllReduce", "BucketedAllReduce", "RingAllReduce", "Compressor",
           "NoCompression", "CastCompressor", "get_compressor", "DEFAULT_BUCKET_BYTES"]
