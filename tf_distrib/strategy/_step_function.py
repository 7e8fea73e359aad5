"""Keras' train and test step functions under `make_strategy()`'s strategies, one step a
call without the `tf.experimental.Optional` round trip.

Keras 3's TensorFlow trainer wraps each step's logs in an Optional and, back in Python,
asks it `has_value()` and then `get_value()`: two eager ops per step (0.22 ms of a small
model's step on one core, 2-3% of the benchmark MLP's). With `steps_per_execution=1` the
answer is always yes: the step calls `iterator.get_next()`, which raises OutOfRangeError
at the end of the data (Keras' epoch iterator turns it into the end of the epoch)
instead of returning an empty Optional. So for models under strategies that
`make_strategy()` made, such a step returns its logs directly. Every other call (more
steps per execution, eager runs, data that is not an iterator, other strategies) runs
Keras' own function.

Keras offers no hook for its step functions, so `_make_function` is replaced on the
trainer class, once, and dispatches on the model's strategy.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib import _compat

# Attribute of a strategy whose models take the direct step.
_ATTRIBUTE = "_tf_distrib_direct_steps"


def mark(strategy: tf.distribute.Strategy) -> None:
    """Makes models compiled under `strategy` (one of `make_strategy()`'s) step directly."""
    _compat.patch_trainer("_make_function", _direct_steps, "the direct step function")
    setattr(strategy, _ATTRIBUTE, True)


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

        def direct_function(iterator):
            if self.steps_per_execution == 1 and isinstance(
                    iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                return one_step_on_iterator(iterator)
            return function(iterator)

        return direct_function

    return make_function
