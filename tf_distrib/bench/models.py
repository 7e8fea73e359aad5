"""The models the benchmarks train."""

from __future__ import annotations


def mlp(hidden=(512, 512), optimizer=None, inputs=784):
    """A compiled MLP inputs-hidden...-10 for sparse labels; SGD(0.01) unless `optimizer` given."""
    import keras

    model = keras.Sequential([keras.Input((inputs,))]
                             + [keras.layers.Dense(n, activation="relu") for n in hidden]
                             + [keras.layers.Dense(10)])
    model.compile(optimizer or keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
