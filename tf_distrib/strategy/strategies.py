"""The strategies `make_strategy()` returns: Keras 3's fixes for MWMS, CPU input iterators."""

from __future__ import annotations

import atexit

import tensorflow as tf

from tf_distrib import _compat
from tf_distrib.health import phases
from tf_distrib.health import watchdog as watchdog_lib
from tf_distrib.strategy import _equal_batches, _input_iterators
from tf_distrib.transport import graph_op


class _HostInput:
    """A strategy's input iterators as CPU workers want them.

    They keep glibc's large buffers mapped (`_malloc`), tear the spent iterators of
    datasets given to `fit` down off the training thread (`_input_iterators`), and,
    when every device of this worker is a CPU, do not copy each replica's batch from
    the host onto its device: logical CPUs share host memory, so the copy buys nothing
    and cost `HostMirroredStrategy` 10-20% of its step rate (measured: `make bench`).
    A worker of one CPU device (a CPU worker under MWMS) iterates with plain tf.data
    iterators instead of TF's MultiDeviceIterator, which made tf.data rewrite the whole
    pipeline again for every epoch's iterators (`_compat.iterate_with_plain_iterators`).
    A plain dataset whose global batches are all full skips TensorFlow's per-step check
    that every replica still has data (`_equal_batches`). A caller's own `InputOptions`
    are kept.
    """

    _HOST_INPUT = tf.distribute.InputOptions(experimental_fetch_to_device=False)

    @property
    def _all_cpu(self) -> bool:
        return all(tf.DeviceSpec.from_string(d).device_type == "CPU"
                   for d in self.extended.worker_devices)

    def _input_options(self, options):
        return self._HOST_INPUT if options is None and self._all_cpu else options

    def experimental_distribute_dataset(self, dataset, options=None):
        # What Keras calls for a dataset given to `fit`: the user's own pipeline.
        distributed = super().experimental_distribute_dataset(dataset,
                                                              self._input_options(options))
        checks = getattr(distributed, "_enable_get_next_as_optional", False)
        needs = checks and not _equal_batches.every_replica_has_a_batch(dataset)
        if self._nobody_needs_the_check(needs) and checks:  # every worker asks, first
            _compat.skip_partial_batch_checks(distributed)
        return self._managed(distributed, options, retire=True)

    def _nobody_needs_the_check(self, needs: bool) -> bool:
        if self.num_replicas_in_sync == len(self.extended.worker_devices):
            return not needs
        # Workers may build different pipelines: all must skip the per-step check, or
        # none (a collective that one worker skips would hang the others). So every
        # worker takes part here, whatever its dataset.
        needing = self.reduce(tf.distribute.ReduceOp.SUM, tf.constant(float(needs)), axis=None)
        return float(needing) == 0.0

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        return self._managed(
            super().distribute_datasets_from_function(dataset_fn, self._input_options(options)),
            options, retire=False)

    def _managed(self, distributed, options, retire: bool):
        if options is None and len(self.extended.worker_devices) == 1 and self._all_cpu:
            _compat.iterate_with_plain_iterators(distributed)
        return _input_iterators.managed(distributed, retire=retire)


class KerasMultiWorkerMirroredStrategy(_HostInput,
                                       tf.distribute.MultiWorkerMirroredStrategy):
    """MultiWorkerMirroredStrategy that Keras 3's `fit`, `evaluate` and `predict` can use.

    Keras 3 meets three upstream bugs under MWMS. It calls `strategy.reduce` in two ways
    that MWMS rejects (keras-team/keras#20585, tensorflow/tensorflow#72388):

    1. `_maybe_symbolic_build` reduces a nested (x, y) structure in one call, but
       MWMS's `_reduce_to` accepts one value only;
    2. `reduce_per_replica(reduction="auto")` reduces scalar logs with `axis=0`,
       which fails with "Invalid reduction dimension 0".

    This subclass maps the reduction over nested structures and uses `axis=None`
    for scalars, in its own `reduce` only.

    3. `compile(steps_per_execution=N)` with N > 1 fails ("You must feed a value for
       placeholder tensor", keras-team/keras#19246): Keras runs the train step in a
       `tf.cond` inside a `tf.while_loop`, and TF's collectives defer their instance
       keys to call time (`capture_call_time_value`), which does not reach through
       that nesting. This strategy makes TF assign instance keys at trace time
       instead, TF's other supported mode (`CollectiveReplicaLauncher.
       _prefer_unique_instance_key = False`). That setting is process-wide, from the
       first KerasMultiWorkerMirroredStrategy on: it fixes TF's MirroredStrategy on
       CPUs too, which hits the same error.

    Like `HostMirroredStrategy`, it keeps glibc's mmap threshold where it was before
    TensorFlow's input iterators lowered it to 128 KiB (`tf_distrib.strategy._malloc`: 9% of a
    CPU worker's time went to page faults), and tears the spent input iterators of
    datasets given to `fit` down on a background thread (`tf_distrib.strategy._input_iterators`:
    Keras drops them at every epoch of a finite dataset, and their teardown stalled MWMS
    workers for seconds).

    Drop each fix once its issue is fixed upstream.

    Attributes:
        transport: The `tf_distrib.transport.Transport` that carries this worker's
            gradient all-reduce, or None when TensorFlow's collective does
            (`make_strategy(transport=...)`).
        watchdog: The `tf_distrib.health.watchdog.Watchdog` that stops this worker when its
            steps stop (`make_strategy(hang_timeout=...)`), or None.

    Example:

    ```python
    strategy = td.make_strategy()   # under TF_CONFIG with 2+ workers: this class
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="mse")
    model.fit(dataset, epochs=3)
    ```
    """

    transport = None
    watchdog = None
    _steps = None  # steps run, counted inside each step's graph for the watchdog

    def run(self, fn, args=(), kwargs=None, options=None):
        # The first step is being traced. Without a watchdog nobody sees it finish: start-up
        # ends here then.
        phases.enter(phases.FIRST_STEP if self.watchdog is not None else phases.TRAINING)
        result = super().run(fn, args=args, kwargs=kwargs, options=options)
        if self._steps is not None:
            with tf.control_dependencies(tf.nest.flatten(result, expand_composites=True)):
                self._steps.assign_add(1)
        return result

    def start_watchdog(self, task: str, timeout: float, key: str) -> None:
        """Starts this worker's hang watchdog (`make_strategy` does, unless told not to)."""
        with tf.init_scope():
            self._steps = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name="tf_distrib_steps")
        self.watchdog = watchdog_lib.Watchdog(task, timeout, lambda: int(self._steps.numpy()),
                                              transport=self.transport, key=key)
        atexit.register(self.watchdog.stop)

    def __init__(self, *args, **kwargs):
        _compat.use_trace_time_collective_keys()
        super().__init__(*args, **kwargs)

    def reduce(self, reduce_op, value, axis):
        if not _is_single_value(value):
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        if axis is not None and _rank(value) == 0:
            axis = None
        if isinstance(reduce_op, str):
            reduce_op = tf.distribute.ReduceOp(reduce_op.upper())
        if axis is None and self.transport is not None and _is_small(value, reduce_op):
            # Keras reduces each logged value every step, and TF's distributed iterators
            # count the workers that still have data every step of a finite dataset:
            # through TF's RPC each costs ~1 ms of CPU, through the transport ~0.1 ms, and
            # a worker that waits for a slow peer there is seen by the transport (the
            # straggler report), not hidden in TensorFlow's collective.
            if isinstance(value, tf.distribute.DistributedValues):
                value = value.values[0]
            [total] = graph_op.all_reduce(self.transport, [tf.reshape(value, [-1])])
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                total = total / self.num_replicas_in_sync
            return tf.reshape(total, tf.shape(value))
        return super().reduce(reduce_op, value, axis)


class HostMirroredStrategy(_HostInput, tf.distribute.MirroredStrategy):
    """MirroredStrategy over CPU devices that share host memory.

    Its input iterators do not copy each replica's batch onto its device (logical CPUs
    share one memory) unless the caller passes its own `InputOptions` and keep glibc's
    mmap threshold (`tf_distrib.strategy._malloc`); those of datasets given to `fit` are torn
    down off the training thread.

    Args:
        devices: The CPU devices, as `tf.distribute.MirroredStrategy` takes them.
            Defaults to None: every visible device.
        cross_device_ops: As `tf.distribute.MirroredStrategy`'s. Defaults to None:
            `make_strategy()` passes `ReductionToOneDevice`.

    Example:

    ```python
    td.use_logical_cpus(2)
    strategy = td.make_strategy()   # two CPU replicas: a HostMirroredStrategy
    ```
    """


class HostOneDeviceStrategy(_HostInput, tf.distribute.OneDeviceStrategy):
    """OneDeviceStrategy on a process's one CPU, with `HostMirroredStrategy`'s input iterators.

    `make_strategy()` returns it where the default strategy would have to serve a process
    that has one CPU device and no cluster. Under the default strategy Keras drops each
    epoch's spent iterator of a finite dataset on the training thread, whose teardown
    waits for tf.data's autotuning thread: on one core that stopped training about 1 s
    per epoch (steps of 7.5 ms of CPU took 12.5 ms each over 200-step epochs). Here the
    spent iterators go to the background thread that tf_distrib's other strategies hand
    theirs to, and the worker iterates with a plain tf.data iterator, without copying each
    batch onto its device. The arithmetic is the default strategy's: one replica, nothing
    reduced; its step costs 0.1-0.2 ms more CPU (TensorFlow flattens the distributed
    iterator at every call of the step's function).

    Example:

    ```python
    strategy = td.make_strategy()  # one CPU, no TF_CONFIG: a HostOneDeviceStrategy
    with strategy.scope():
        model = build_model()
    model.fit(dataset.batch(128), epochs=10)
    ```
    """


def _is_single_value(value) -> bool:
    flat = tf.nest.flatten(value, expand_composites=False)
    return len(flat) == 1 and flat[0] is value


# Values of at most this many elements go through the transport's polled path.
_SMALL_ELEMENTS = 64


def _is_small(value, reduce_op) -> bool:
    """A dense float (SUM, MEAN) or integer (SUM) tensor of known size, at most 64 elements."""
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    if not isinstance(value, tf.Tensor) or not value.shape.is_fully_defined():
        return False
    if value.shape.num_elements() > _SMALL_ELEMENTS:
        return False
    return value.dtype.is_floating or (value.dtype.is_integer
                                       and reduce_op == tf.distribute.ReduceOp.SUM)


def _rank(value):
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    shape = getattr(value, "shape", None)
    return None if shape is None else shape.rank
