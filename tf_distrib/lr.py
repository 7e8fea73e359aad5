"""Learning rates for large global batches: scaling rules and warmup (Goyal et al. 2017).

Example:

```python
lr = td.lr.scale_learning_rate(0.1, base_batch=256, global_batch=8192)   # 3.2
schedule = td.lr.LinearWarmup(lr, warmup_steps=500)
optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
```
"""

from __future__ import annotations

import math

import keras

from tf_distrib._checks import check_int

__all__ = ["scale_learning_rate", "LinearWarmup", "SCALING_RULES"]

SCALING_RULES = ("linear", "sqrt")


def scale_learning_rate(base_lr: float, base_batch: int, global_batch: int,
                        rule: str = "linear") -> float:
    """The learning rate for `global_batch`, given one tuned for `base_batch`.

    Args:
        base_lr: Learning rate tuned at `base_batch`.
        base_batch: Batch size `base_lr` was tuned for.
        global_batch: The global batch size now (all replicas together).
        rule: "linear" (lr x k, Goyal et al. 2017, for SGD) or "sqrt" (lr x sqrt(k),
            often better for Adam). Defaults to "linear".

    Returns:
        The scaled learning rate.

    Example:

    ```python
    lr = td.lr.scale_learning_rate(0.1, base_batch=256, global_batch=1024)   # 0.4
    ```
    """
    if rule not in SCALING_RULES:
        raise ValueError(f"rule must be one of {SCALING_RULES}, got {rule!r}.")
    check_int("base_batch", base_batch)
    check_int("global_batch", global_batch)
    if not base_lr > 0:
        raise ValueError(f"base_lr must be > 0, got {base_lr!r}.")
    factor = global_batch / base_batch
    return base_lr * (factor if rule == "linear" else math.sqrt(factor))


@keras.saving.register_keras_serializable(package="tf_distrib")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Rises linearly from `initial_learning_rate` to `after`, then follows `after`.

    During the first `warmup_steps` steps the rate is
    `initial + (target - initial) * step / warmup_steps`, where `target` is `after`
    (a float) or `after(0)` (a schedule); from then on it is `after(step - warmup_steps)`.

    Args:
        after: The learning rate after warmup: a float, or a
            `keras.optimizers.schedules.LearningRateSchedule` started at the end of warmup.
        warmup_steps: Steps of warmup, >= 1.
        initial_learning_rate: The rate at step 0. Defaults to 0.0.

    Example:

    ```python
    decay = keras.optimizers.schedules.CosineDecay(3.2, decay_steps=10_000)
    schedule = td.lr.LinearWarmup(decay, warmup_steps=500)
    ```
    """

    def __init__(self, after: float | keras.optimizers.schedules.LearningRateSchedule,
                 warmup_steps: int, initial_learning_rate: float = 0.0):
        super().__init__()
        check_int("warmup_steps", warmup_steps)
        if isinstance(after, dict):  # from get_config
            after = keras.saving.deserialize_keras_object(after)
        self.after = after
        self.warmup_steps = warmup_steps
        self.initial_learning_rate = float(initial_learning_rate)

    def _after(self, step):
        if isinstance(self.after, keras.optimizers.schedules.LearningRateSchedule):
            return self.after(step)
        return keras.ops.convert_to_tensor(float(self.after))

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        target = keras.ops.cast(self._after(0), "float32")
        progress = keras.ops.minimum(step / self.warmup_steps, 1.0)
        warm = self.initial_learning_rate + (target - self.initial_learning_rate) * progress
        later = keras.ops.cast(self._after(keras.ops.maximum(step - self.warmup_steps, 0.0)),
                               "float32")
        return keras.ops.where(step < self.warmup_steps, warm, later)

    def get_config(self):
        after = self.after
        if isinstance(after, keras.optimizers.schedules.LearningRateSchedule):
            after = keras.saving.serialize_keras_object(after)
        return {"after": after, "warmup_steps": self.warmup_steps,
                "initial_learning_rate": self.initial_learning_rate}
