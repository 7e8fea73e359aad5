"""Run a callback on the chief worker only; one progress bar per multi-worker run."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_distrib import cluster as cluster_lib


def is_chief(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Whether this process is the chief (True outside multi-worker runs).

    Args:
        strategy: Ask this strategy. Defaults to None: the cluster in the environment
            (TF_CONFIG, CLUSTER_SPEC or Slurm), with tf.distribute's rule (the "chief"
            task, else worker 0).
    """
    if strategy is not None:
        return bool(strategy.extended.should_checkpoint)
    spec = cluster_lib.from_environment()
    return spec is None or spec.is_chief


def chief_verbose(verbose="auto", strategy: tf.distribute.Strategy | None = None):
    """`verbose` on the chief, 0 on the other workers: one progress bar per run.

    Args:
        verbose: Keras' `verbose` for the chief. Defaults to "auto".
        strategy: The strategy whose cluster says who the chief is. Defaults to None:
            the current one.

    Example:

    ```python
    model.fit(dataset, epochs=3, verbose=td.callbacks.chief_verbose())
    ```
    """
    return verbose if is_chief(strategy) else 0


class ChiefOnly(keras.callbacks.Callback):
    """Runs `callback` on the chief worker only.

    In a multi-worker run every worker calls every callback; wrap those that write
    files or print (ModelCheckpoint, TensorBoard, CSVLogger, custom loggers) so only
    the chief does. Outside multi-worker runs the callback always runs. Do not wrap
    callbacks that must run everywhere (BackupAndRestore, EarlyStopping: every
    worker has to stop together).

    Args:
        callback: The Keras callback to run on the chief.

    Example:

    ```python
    model.fit(dataset, epochs=3, verbose=td.callbacks.chief_verbose(), callbacks=[
        td.callbacks.ChiefOnly(keras.callbacks.CSVLogger("log.csv"))])
    ```
    """

    def __init__(self, callback: keras.callbacks.Callback):
        super().__init__()
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(f"ChiefOnly wraps a keras.callbacks.Callback, got "
                            f"{type(callback).__name__}.")
        self.callback = callback
        self._active = None

    def set_model(self, model):
        super().set_model(model)
        self._active = is_chief(model.distribute_strategy)
        if self._active:
            self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)


def _forward(hook: str):
    def forward(self, *args, **kwargs):
        if self._active:
            return getattr(self.callback, hook)(*args, **kwargs)
        return None

    forward.__name__ = hook
    return forward


# Every Keras hook (on_train_begin, on_epoch_end, on_test_batch_end, ...).
for _hook in (name for name in dir(keras.callbacks.Callback) if name.startswith("on_")):
    setattr(ChiefOnly, _hook, _forward(_hook))
