"""`tf_distrib_blobs`: a TFDS dataset of 4-class Gaussian blobs in 16 dimensions.

Generated from a fixed seed (the same data as `tf_distrib.demo.make_data`), so it
builds offline in a second and is identical everywhere. Each example has "features"
(16 float32), "label" (0-3) and "id" (its index in the split, for exactly-once checks).
"""

from __future__ import annotations

NAME = "tf_distrib_blobs"
SPLITS = {"train": (4096, 0), "test": (1024, 1)}  # examples, seed


def _builder_class():
    import numpy as np
    import tensorflow_datasets as tfds

    from tf_distrib.demo import NUM_CLASSES, NUM_FEATURES, make_data

    class TfDistribBlobs(tfds.core.GeneratorBasedBuilder):
        """4-class Gaussian blobs in 16 dimensions, generated locally."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description=__doc__,
                features=tfds.features.FeaturesDict({
                    "features": tfds.features.Tensor(shape=(NUM_FEATURES,), dtype=np.float32),
                    "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
                    "id": tfds.features.Scalar(dtype=np.int64),
                }),
                supervised_keys=("features", "label"),
            )

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(n, seed)
                    for split, (n, seed) in SPLITS.items()}

        def _generate_examples(self, num_examples, seed):
            x, y = make_data(num_examples, seed)
            for i in range(num_examples):
                yield i, {"features": x[i], "label": int(y[i]), "id": i}

    return TfDistribBlobs


_CLASS = None


def prepare(data_dir: str):
    """Builds `tf_distrib_blobs` into `data_dir` (once; later calls only open it).

    Args:
        data_dir: The TFDS data directory.

    Returns:
        The prepared `tfds.core.DatasetBuilder`.
    """
    global _CLASS
    if _CLASS is None:
        # Defining the class registers it with TFDS under NAME; only once per process.
        _CLASS = _builder_class()
    builder = _CLASS(data_dir=data_dir)
    builder.download_and_prepare()
    return builder
