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


def cnn(optimizer=None):
    """A compiled convolutional network on 32x32x3 images, 10 classes, 0.6M parameters.

    Three 3x3 convolutions (32, 64, 64 filters, each followed by 2x2 max pooling), then
    dense 512 and 10: the shape of a CIFAR-10 baseline, small enough for one core.
    """
    import keras

    layers = [keras.Input((32, 32, 3))]
    for filters in (32, 64, 64):
        layers += [keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
                   keras.layers.MaxPooling2D()]
    model = keras.Sequential(layers + [keras.layers.Flatten(),
                                       keras.layers.Dense(512, activation="relu"),
                                       keras.layers.Dense(10)])
    model.compile(optimizer or keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
