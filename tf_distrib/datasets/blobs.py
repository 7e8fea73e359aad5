"""`tf_distrib_blobs`: 4-class Gaussian blobs in 16 dimensions, and a model for them.

`make_data` generates the examples from a fixed seed as numpy arrays; `prepare` builds
the same data as a TFDS dataset offline in a second, identical everywhere. Each TFDS
example has "features" (16 float32), "label" (0-3) and "id" (its index in the split,
for exactly-once checks). `build_model` is the small classifier the demo, the
notebooks and the tests train on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tf_distrib._scratch import scratch_tempdir

if TYPE_CHECKING:
    import tensorflow_datasets as tfds

NAME = "tf_distrib_blobs"
SPLITS = {"train": (4096, 0), "test": (1024, 1)}  # examples, seed
NUM_EXAMPLES = SPLITS["train"][0]
NUM_FEATURES = 16
NUM_CLASSES = 4


def make_data(num_examples: int = NUM_EXAMPLES, seed: int = 0):
    """A generated 4-class problem: Gaussian blobs in 16 dimensions (numpy arrays).

    Args:
        num_examples: How many examples. Defaults to `NUM_EXAMPLES`.
        seed: The generator's seed; the same seed gives the same data. Defaults to 0.

    Returns:
        (x, y): float32 features of shape (num_examples, 16) and int32 labels 0-3.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    centers = rng.normal(0.0, 2.0, size=(NUM_CLASSES, NUM_FEATURES))
    y = rng.integers(0, NUM_CLASSES, size=num_examples)
    x = centers[y] + rng.normal(0.0, 1.5, size=(num_examples, NUM_FEATURES))
    return x.astype("float32"), y.astype("int32")


def build_model():
    """A compiled MLP 16-64-64-4 for the blobs (SGD with momentum, sparse labels, accuracy)."""
    import keras

    model = keras.Sequential([
        keras.Input((NUM_FEATURES,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(NUM_CLASSES),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _builder_class():
    import numpy as np
    import tensorflow_datasets as tfds

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


def prepare(data_dir: str) -> tfds.core.DatasetBuilder:  # noqa: F821
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
    # A builder of a dataset not yet prepared leaves an empty directory in the temporary
    # directory (TFDS' `DatasetInfo.initialize_from_bucket` makes one before it finds no
    # metadata to fetch); it goes into one removed here.
    with scratch_tempdir("tf_distrib_tfds_"):
        builder = _CLASS(data_dir=data_dir)
    builder.download_and_prepare()
    return builder
