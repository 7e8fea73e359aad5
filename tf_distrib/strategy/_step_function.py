"""Keras' train and test step functions under `make_strategy()`'s strategies, one step a
call without the `tf.experimental.Optional` round trip.

Keras 3 wraps each step's logs in an Optional and asks it `has_value()` and `get_value()`
back in Python: two eager ops per step. With `steps_per_execution=1` the answer is always
yes (the end of the data raises OutOfRangeError, which Keras' epoch iterator handles), so
for models under `make_strategy()`'s strategies the step returns its logs directly; every
other call runs Keras' own function. With a step recorder (`tf_distrib.health.steps`) the
step also returns when its wait for the next batch began and ended, and its examples.
Keras has no hook for its step functions: `_make_function` is replaced on the trainer
class, once, and dispatches on the model's strategy.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from tf_distrib import _compat
from tf_distrib.health import steps

# Attribute of a strategy whose models take the direct step.
_ATTRIBUTE = "_tf_distrib_direct_steps"


def mark(strategy: tf.distribute.Strategy) -> None:
    """Makes models compiled under `strategy` (one of `make_strategy()`'s) step directly."""
    _compat.patch_trainer("_make_function", _direct_steps, "the direct step function")
    setattr(strategy, _ATTRIBUTE, True)


def _now() -> tf.Tensor:
    """The wall-clock time when the op runs, in seconds (float64)."""
    if _compat.op_determinism_enabled():
        # TensorFlow refuses its Timestamp op under op determinism; a clock read in Python
        # is allowed (and costs ~20 us more).
        return tf.reshape(tf.numpy_function(lambda: np.float64(time.time()), [], tf.float64,
                                            stateful=True), [])
    return tf.timestamp()


def _direct_steps(original):
    def make_function(self, step_function):
        function = original(self, step_function)
        if self.run_eagerly or not getattr(self.distribute_strategy, _ATTRIBUTE, False):
            return function
        reduce_per_replica = _compat.keras_reduce_per_replica()

        # Keras' own one-step function (trainer.py, `_make_function`): only what calls it
        # differs.
        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            outputs = self.distribute_strategy.run(step_function, args=(data,))
            return reduce_per_replica(outputs, self.distribute_strategy, reduction="auto")

        one_step_on_data = self._autoconvert_optionals(
            tf.function(one_step_on_data, reduce_retracing=True, jit_compile=self.jit_compile))

        @tf.function(reduce_retracing=True)
        @tf.autograph.experimental.do_not_convert
        def one_step_on_iterator(iterator):
            return one_step_on_data(iterator.get_next())

        @tf.function(reduce_retracing=True)
        @tf.autograph.experimental.do_not_convert
        def timed_step_on_iterator(iterator):
            # When the wait for the next batch began and ended, and this worker's examples.
            began = _now()
            with tf.control_dependencies([began]):
                data = iterator.get_next()
            with tf.control_dependencies(tf.nest.flatten(data, expand_composites=True)):
                ended = _now()
            examples = tf.add_n([tf.cast(tf.shape(tf.nest.flatten(local)[0])[0], tf.float64)
                                 for local in self.distribute_strategy
                                 .experimental_local_results(data)])
            return one_step_on_data(data), tf.stack([began, ended, examples])

        def direct_function(iterator):
            if self.steps_per_execution != 1 or not isinstance(
                    iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                return function(iterator)
            recorder = steps.recorder_of(self.distribute_strategy)
            if recorder is None:
                return one_step_on_iterator(iterator)
            recorder.begin()
            logs, timing = timed_step_on_iterator(iterator)
            began, ended, examples = timing.numpy().tolist()
            recorder.end(ended - began, int(examples), (began, ended))
            return logs

        return direct_function

    return make_function
