"""Gradient communication: compression, bucketing, ring all-reduce.

For MirroredStrategy these are `tf.distribute.CrossDeviceOps`; for
MultiWorkerMirroredStrategy (which only runs TF's collectives) the same compressors
and buckets apply to `model.fit`'s gradient all-reduce through
`make_strategy(compression=..., bucket_bytes=...)`, and PowerSGD's low-rank
compression (`compression="powersgd"`) rides on tf_distrib's transport.
"""

from tf_distrib.cross_device.bucketing import DEFAULT_BUCKET_BYTES
from tf_distrib.cross_device.compression import (
    CastCompressor,
    Compressor,
    NoCompression,
    get_compressor,
)
from tf_distrib.cross_device.ops import BucketedAllReduce, CompressedAllReduce, RingAllReduce
from tf_distrib.cross_device.powersgd import PowerSGD

__all__ = ["CompressedAllReduce", "BucketedAllReduce", "RingAllReduce", "Compressor",
           "NoCompression", "CastCompressor", "get_compressor", "DEFAULT_BUCKET_BYTES",
           "PowerSGD"]
