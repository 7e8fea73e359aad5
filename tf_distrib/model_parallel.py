"""Model parallelism: a model's layers split into stages on several devices (GPipe-style).

Example:

```python
td.use_logical_cpus(2)
model = keras.Sequential([keras.Input((784,)), *big_layers])
piped = td.model_parallel.pipeline(model, ["/cpu:0", "/cpu:1"], num_microbatches=4)
piped.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
piped.fit(x, y, batch_size=256)
print(td.model_parallel.memory_per_device(piped))
```
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from tf_distrib import _compat
from tf_distrib._checks import check_int

__all__ = ["pipeline", "PipelineModel", "balance", "memory_per_device"]


def balance(param_counts: list[int], num_stages: int) -> list[int]:
    """Splits layers (given their parameter counts) into `num_stages` contiguous stages.

    Minimises the largest stage's parameters, then (among equal splits) the sum of
    squared stage sizes, so that every device gets a share. Each stage gets at least
    one layer.

    Returns:
        The number of layers in each stage.
    """
    n = len(param_counts)
    prefix = np.concatenate([[0], np.cumsum(param_counts)])
    # best[k][i]: (largest stage, sum of squares) for the first i layers in k stages.
    best = [[(np.inf, np.inf)] * (n + 1) for _ in range(num_stages + 1)]
    cut = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0][0] = (0, 0)
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                size = prefix[i] - prefix[j]
                cost = (max(best[k - 1][j][0], size), best[k - 1][j][1] + size * size)
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


class PipelineModel(keras.Model):
    """A model whose stages run on their own devices; built by `pipeline()`.

    Each step splits the batch into `num_microbatches` micro-batches whose losses are
    averaged and whose gradients are summed before one optimizer update: the same
    update as one big batch. TensorFlow runs micro-batch m+1 on stage k while
    micro-batch m is on stage k+1, since nothing orders them.

    Args:
        stages: One `keras.Sequential` per device.
        devices: The devices, stage k's on `devices[k]`.
        num_microbatches: Micro-batches per step. Defaults to 1.
    """

    def __init__(self, stages: list[keras.Sequential], devices: list[str],
                 num_microbatches: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.stages = stages
        self.devices = list(devices)
        self.num_microbatches = num_microbatches

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        # Build the optimizer now, eagerly, so each slot lands next to its variable:
        # built inside the first traced step, all slots would go to one device.
        self.optimizer.build(self.trainable_variables)

    def call(self, x, training=None):
        for stage, device in zip(self.stages, self.devices, strict=True):
            with tf.device(device):
                x = stage(x, training=training)
        return x

    def train_step(self, data):
        if self.num_microbatches == 1:
            return super().train_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        m = self.num_microbatches
        batch = tree.flatten(x)[0].shape[0]
        if batch is not None and batch % m:
            raise ValueError(f"num_microbatches={m} does not divide the batch of {batch}; "
                             f"use a batch size that is a multiple of {m}.")
        xs, ys, ws = (_split(v, m) for v in (x, y, sample_weight))
        weights = self.trainable_weights
        total, predictions = None, []
        for x_i, y_i, w_i in zip(xs, ys, ws, strict=True):
            with tf.GradientTape() as tape:
                y_pred = self(x_i, training=True)
                loss = _compat.compute_loss(self, x=x_i, y=y_i, y_pred=y_pred,
                                            sample_weight=w_i, training=True) / m
                scaled = self.optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, weights)
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
            predictions.append(y_pred)
            _compat.loss_tracker(self).update_state(loss * m, sample_weight=tf.shape(
                tree.flatten(x_i)[0])[0])
        self.optimizer.apply_gradients(zip(total, weights, strict=True))
        y_pred = tree.map_structure(lambda *p: tf.concat(p, axis=0), *predictions)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _split(structure, m: int) -> list:
    """`m` micro-batches of a (nested) batch, along the first axis."""
    if structure is None:
        return [None] * m
    pieces = [tf.split(t, m) for t in tree.flatten(structure)]
    return [tree.pack_sequence_as(structure, [p[i] for p in pieces]) for i in range(m)]


def pipeline(model: keras.Sequential | list[list[keras.layers.Layer]], devices: list[str], *,
             num_microbatches: int = 1) -> PipelineModel:
    """Splits `model` into `len(devices)` stages, stage k's variables on `devices[k]`.

    Args:
        model: A built `keras.Sequential`, split automatically into stages of balanced
            parameter counts; or a list of layer lists, one per stage (explicit stages).
        devices: One device per stage, e.g. ["/gpu:0", "/gpu:1"] or logical CPUs.
        num_microbatches: Micro-batches per step (gradients accumulated, one update).
            Must divide the batch size. Defaults to 1.

    Returns:
        An uncompiled `PipelineModel` with the same weights and function as `model`.

    Raises:
        ValueError: more stages than layers, an unknown device, a model that is not
            Sequential or not built, a bad `num_microbatches`.
        TypeError: a layer that cannot be re-created on its device (no `get_config`).

    Example:

    ```python
    split = td.model_parallel.pipeline(model, ["/gpu:0", "/gpu:1"], num_microbatches=4)
    split.compile(optimizer="adam", loss="mse")
    split.fit(x, y, epochs=3)
    ```
    """
    check_int("num_microbatches", num_microbatches)
    devices = _check_devices(devices)
    if isinstance(model, (list, tuple)):
        groups = [list(g) for g in model]
        if len(groups) != len(devices):
            raise ValueError(f"{len(groups)} layer groups for {len(devices)} devices; give one "
                             "group per device.")
        if not all(groups):
            raise ValueError("Every layer group needs at least one layer.")
        layers = [layer for g in groups for layer in g]
        input_shape = _built_input_shape(layers[0])
    else:
        if not isinstance(model, keras.Sequential):
            raise ValueError(f"pipeline() splits a keras.Sequential (or a list of layer "
                             f"groups), got {type(model).__name__}; a functional model's "
                             "layers have no single order to split.")
        if not model.built:
            raise ValueError("The model is not built; give it a keras.Input or call "
                             "model.build(input_shape) first.")
        layers = list(model.layers)
        if len(devices) > len(layers):
            raise ValueError(f"{len(devices)} devices but the model has only {len(layers)} "
                             f"layers: use at most {len(layers)} stages.")
        sizes = balance([layer.count_params() for layer in layers], len(devices))
        groups, start = [], 0
        for size in sizes:
            groups.append(layers[start:start + size])
            start += size
        input_shape = model.inputs[0].shape
    stages = []
    shape = input_shape
    for k, (group, device) in enumerate(zip(groups, devices, strict=True)):
        with tf.device(device):
            stage = keras.Sequential([_clone(layer) for layer in group], name=f"stage_{k}")
            stage.build(shape)
        for clone, layer in zip(stage.layers, group, strict=True):
            clone.set_weights(layer.get_weights())
        shape = stage.compute_output_shape(shape)
        stages.append(stage)
    piped = PipelineModel(stages, devices, num_microbatches)
    piped.build(input_shape)
    return piped


def _check_devices(devices) -> list[str]:
    if isinstance(devices, str) or not devices:
        raise ValueError(f"devices must be a non-empty list of device names, got {devices!r}.")
    known = {d.name for d in tf.config.list_logical_devices()}
    names = []
    for device in devices:
        try:
            spec = tf.DeviceSpec.from_string(device)
        except ValueError:
            spec = None
        matches = [name for name in known if spec is not None and spec.device_type
                   and tf.DeviceSpec.from_string(name).device_type == spec.device_type.upper()
                   and tf.DeviceSpec.from_string(name).device_index == spec.device_index]
        if not matches:
            raise ValueError(f"Unknown device {device!r}; this process has {sorted(known)} "
                             "(use td.use_logical_cpus(n) for several CPU devices).")
        names.append(matches[0])
    return names


def _clone(layer):
    # Keras 3 derives a config from __init__'s arguments when a layer has no
    # get_config(); re-creating from it fails with TypeError when that guess is wrong.
    try:
        return layer.__class__.from_config(layer.get_config())
    except (NotImplementedError, TypeError) as e:
        raise TypeError(f"Layer {layer.name!r} ({type(layer).__name__}) cannot be placed on a "
                        f"device: it cannot be re-created from get_config() ({e}); implement "
                        "get_config() for it.") from e


def _built_input_shape(layer):
    shape = getattr(layer, "_build_shapes_dict", None) or {}
    if not layer.built or not shape:
        raise ValueError(f"Layer {layer.name!r} is not built; build the layers (e.g. in a "
                         "model with a keras.Input) before splitting them.")
    return next(iter(shape.values()))


def memory_per_device(model: PipelineModel) -> dict[str, dict[str, int]]:
    """Parameters and bytes held on each device (weights and optimizer slots)."""
    usage: dict[str, dict[str, int]] = {}
    variables = list(model.weights)
    if model.optimizer is not None and model.optimizer.built:
        variables += list(model.optimizer.variables)
    for v in variables:
        device = v.value.device
        entry = usage.setdefault(device, {"parameters": 0, "bytes": 0})
        count = int(np.prod(v.shape))
        entry["parameters"] += count
        entry["bytes"] += count * tf.as_dtype(v.dtype).size
    return usage
