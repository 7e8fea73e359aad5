"""One call that picks and configures the right tf.distribute strategy for Keras 3.

Example:

```python
import tf_distrib as td

td.use_logical_cpus(4)          # laptops and tests: 4 replicas on one CPU
strategy = td.make_strategy()   # MWMS under TF_CONFIG, else MirroredStrategy
with strategy.scope():
    model = build_model()
    model.compile(...)
model.fit(dataset, epochs=3)
```
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import sys
import threading
import warnings

import tensorflow as tf

from tf_distrib import (
    _compat,
    _equal_batches,
    _input_iterators,
    _step_function,
    contract,
    cross_device,
    optimizer_hooks,
    phases,
)
from tf_distrib import cluster as cluster_lib
from tf_distrib import transport as transport_lib
from tf_distrib import watchdog as watchdog_lib
from tf_distrib._checks import check_int
from tf_distrib.contract import ENV_STARTUP_TIMEOUT, STARTUP_TIMEOUT_EXIT_CODE
from tf_distrib.cross_device import gradients
from tf_distrib.transport import graph_op

__all__ = ["make_strategy", "use_logical_cpus", "KerasMultiWorkerMirroredStrategy",
           "HostMirroredStrategy", "HostOneDeviceStrategy", "STARTUP_TIMEOUT_EXIT_CODE"]

_DEFAULT_STARTUP_TIMEOUT = 600.0
_MULTI_WORKER_STRATEGIES = itertools.count(1)


def use_logical_cpus(n: int) -> None:
    """Splits the host CPU into `n` logical devices, one replica each.

    Call it once at the top of the program, before TensorFlow creates any tensor,
    model or strategy. Calling it again with the same `n` does nothing.

    Args:
        n: Number of logical CPU devices, >= 1.

    Raises:
        ValueError: if `n` is not a positive integer.
        RuntimeError: if TensorFlow already initialised its devices with another
            layout; the message says how to fix it.

    Example:

    ```python
    td.use_logical_cpus(2)
    assert td.make_strategy().num_replicas_in_sync == 2
    ```
    """
    check_int("n", n)
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if len(current or [None]) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices("CPU"))
        raise RuntimeError(
            f"use_logical_cpus({n}) came too late: TensorFlow has already initialised "
            f"{have} CPU device(s). Call it first thing, right after `import tf_distrib`, "
            "before any tensor, model, dataset or strategy is created (in a notebook, "
            "restart the kernel and run it in the first cell)."
        ) from e


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
    TensorFlow's input iterators lowered it to 128 KiB (`tf_distrib._malloc`: 9% of a
    CPU worker's time went to page faults), and tears the spent input iterators of
    datasets given to `fit` down on a background thread (`tf_distrib._input_iterators`:
    Keras drops them at every epoch of a finite dataset, and their teardown stalled MWMS
    workers for seconds).

    Drop each fix once its issue is fixed upstream.

    Attributes:
        transport: The `tf_distrib.transport.Transport` that carries this worker's
            gradient all-reduce, or None when TensorFlow's collective does
            (`make_strategy(transport=...)`).
        watchdog: The `tf_distrib.watchdog.Watchdog` that stops this worker when its
            steps stop (`make_strategy(hang_timeout=...)`), or None.
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
    mmap threshold (`tf_distrib._malloc`); those of datasets given to `fit` are torn
    down off the training thread.
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


def make_strategy(cross_device_ops: tf.distribute.CrossDeviceOps | None = None, *,
                  compression: str | None = None, bucket_bytes: int | None = None,
                  transport: str | None = None,
                  hang_timeout: float | None = None,
                  communication_timeout: float | None = None,
                  startup_timeout: float | None = None,
                  cluster: cluster_lib.ClusterSpec | None = None) -> tf.distribute.Strategy:
    """Returns the strategy that fits this process, ready for Keras `model.fit`.

    - A cluster with two or more training tasks (TF_CONFIG, Vertex AI's CLUSTER_SPEC
      or Slurm, in that order) -> `KerasMultiWorkerMirroredStrategy` (MWMS with the
      Keras 3 fixes), NCCL on GPUs and ring collectives on CPU.
      An "evaluator" task (a side-car outside the collective) gets a local strategy.
    - Otherwise, several local GPUs -> `tf.distribute.MirroredStrategy` (NCCL).
    - Otherwise, several logical CPUs (`use_logical_cpus`) -> `HostMirroredStrategy`,
      a MirroredStrategy with `ReductionToOneDevice` (TF's default, a ring
      collective, halves throughput on CPU) and no per-device input prefetch.
    - Otherwise one CPU -> `HostOneDeviceStrategy`, a OneDeviceStrategy whose input
      iterators do not stop training at each epoch's end; one GPU -> the default strategy.
      On one device `cross_device_ops`, `compression` and `bucket_bytes` have nothing to
      reduce: a warning says so.

    Args:
        cross_device_ops: A `tf.distribute.CrossDeviceOps` for MirroredStrategy.
            Defaults to None: NCCL on GPUs, `ReductionToOneDevice` on CPUs.
            MWMS cannot take one (it only runs TF's collectives); passing one for a
            multi-worker cluster raises ValueError.
        compression: Gradient compression: "bf16", "fp16" or None. On MirroredStrategy
            it wraps the cross-device op in `cross_device.CompressedAllReduce` (inside
            the buckets, when there are buckets); on MWMS
            it compresses `model.fit`'s gradient all-reduce (metrics stay exact).
            Defaults to None.
        bucket_bytes: Pack gradients into buckets of at most this many bytes before
            reducing them (`cross_device.BucketedAllReduce` on MirroredStrategy; on MWMS,
            buckets of consecutive gradients, last layer first, one collective each).
            Defaults to None: no buckets on MirroredStrategy; on MWMS 25 MiB buckets
            with tf_distrib's transport or `compression` (on one host at most what the
            transport sums in place in shared memory, 16 MiB where /dev/shm has room;
            across hosts the first closes at 1 MiB, as PyTorch DDP's: it travels while
            backward computes the rest), else TF's all-reduce, which packs all
            gradients into one tensor.
        transport: What carries MWMS's gradient all-reduce (`tf_distrib.transport`):
            "auto" (tf_distrib's transport on CPU workers with one replica each:
            shared memory when every worker shares this host; shared memory within
            hosts and TCP rings between them when hosts run the same number of
            workers; else a TCP ring; TensorFlow's collective otherwise, NCCL on
            GPUs), "tf" (TensorFlow's
            collective), "shm" or "tcp". Keras' logged losses and metrics, and the
            per-step count of workers that still have data of a finite dataset, go
            through it too (uncompressed); other reductions use TensorFlow's. If some
            worker cannot listen, every worker falls back to "tf" with a
            warning that says why. Defaults to None: the TF_DISTRIB_TRANSPORT
            environment variable, else "auto".
        hang_timeout: Seconds without a finished step (training, evaluation or
            prediction) after which each MWMS worker writes a flight-recorder report
            and exits with status `contract.HUNG_EXIT_CODE` (76), instead of waiting
            forever for a stuck peer (`tf_distrib.watchdog`); it also bounds the
            transport's rendezvous at start-up. `math.inf` disables the watchdog.
            Defaults to None: TF_DISTRIB_HANG_TIMEOUT when set (the launcher's
            --hang-timeout), else 600.
        communication_timeout: Seconds after which a stuck TensorFlow collective fails
            with `DeadlineExceededError` instead of waiting, and after which a silent
            peer counts as lost on tf_distrib's transport (MWMS only). Defaults to None:
            TF's own heartbeat reports a dead peer after about 10 s; the transport
            waits 30 s for a peer that sends nothing, not even its heartbeat.
        startup_timeout: Seconds to wait for every worker of the cluster to join.
            A worker whose peers do not all join in time prints which ones are
            missing and exits with status `STARTUP_TIMEOUT_EXIT_CODE` (75), since
            TensorFlow would otherwise block forever and the blocked call cannot be
            interrupted. `math.inf` waits forever. Defaults to None: the
            launcher's TF_DISTRIB_STARTUP_TIMEOUT when set, else 600.
        cluster: The cluster to use. Defaults to `cluster.from_environment()`.

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ClusterConfigError: if the environment's cluster is invalid or has roles
            that MWMS cannot use.
        ValueError: for arguments that do not fit the chosen strategy.
    """
    if communication_timeout is not None and communication_timeout <= 0:
        raise ValueError(f"communication_timeout must be > 0 seconds or None, got "
                         f"{communication_timeout!r}.")
    if startup_timeout is None:
        startup_timeout = contract.env_seconds(ENV_STARTUP_TIMEOUT, _DEFAULT_STARTUP_TIMEOUT)
    if not startup_timeout > 0:
        raise ValueError(f"startup_timeout must be > 0 seconds or None, got {startup_timeout!r}.")
    if cross_device_ops is not None and not isinstance(cross_device_ops,
                                                       tf.distribute.CrossDeviceOps):
        raise TypeError(f"cross_device_ops must be a tf.distribute.CrossDeviceOps, got "
                        f"{type(cross_device_ops).__name__}.")
    gradients.GradientAllReduce(compression, bucket_bytes)  # validates both
    if hang_timeout is None:
        hang_timeout = contract.env_seconds(contract.ENV_HANG_TIMEOUT,
                                            watchdog_lib.DEFAULT_HANG_TIMEOUT)
    if not hang_timeout > 0:
        raise ValueError(f"hang_timeout must be > 0 seconds, math.inf or None, got "
                         f"{hang_timeout!r}.")
    transport = transport or os.environ.get(contract.ENV_TRANSPORT) or "auto"
    if transport not in transport_lib.MODES:
        raise ValueError(f"transport must be one of {transport_lib.MODES}, got {transport!r}.")
    spec = cluster_lib.from_environment() if cluster is None else cluster
    # An evaluator is a side-car outside the collective: it evaluates on its own devices.
    if spec is not None and spec.num_workers > 1 and spec.task_type != "evaluator":
        if cross_device_ops is not None:
            raise ValueError(
                "MultiWorkerMirroredStrategy cannot use a custom cross_device_ops: it only "
                "runs TensorFlow's collective all-reduce. Drop cross_device_ops for "
                "multi-worker runs; compression= and bucket_bytes= apply to its gradients."
            )
        spec.check_roles_for("MultiWorkerMirroredStrategy")
        phases.enter(phases.CLUSTER)
        strategy = _multi_worker_strategy(spec, communication_timeout, startup_timeout)
        phases.enter(phases.TRANSPORT)
        # Coordination-service keys of this strategy: every worker makes its strategies
        # in the same order, so the count agrees.
        keys = f"tf_distrib/{next(_MULTI_WORKER_STRATEGIES)}"
        # Every worker has just passed the cluster rendezvous: joining the transport's
        # takes a healthy one well under a second, so the hang timeout bounds it too.
        strategy.transport = _connect_transport(strategy, spec, transport,
                                                min(startup_timeout, hang_timeout),
                                                communication_timeout, f"{keys}/transport")
        reduce = None
        if strategy.transport is not None or compression is not None or bucket_bytes is not None:
            reduce = gradients.GradientAllReduce(compression, bucket_bytes, strategy.transport)
        _mark(strategy, reduce)
        if hang_timeout != math.inf:
            strategy.start_watchdog(spec.task, hang_timeout, f"{keys}/hang")
        phases.enter(phases.BUILDING)
        return strategy

    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        ignored = [name for name, value in (("cross_device_ops", cross_device_ops),
                                            ("compression", compression),
                                            ("bucket_bytes", bucket_bytes)) if value is not None]
        if ignored:
            more = ("; for several CPU replicas call td.use_logical_cpus(n) before "
                    "TensorFlow starts" if not gpus else "")
            warnings.warn(
                f"tf_distrib: make_strategy({', '.join(f'{name}=...' for name in ignored)}) "
                f"has no effect on one {'GPU' if gpus else 'CPU'}: there is nothing to reduce "
                f"across devices{more}. Drop the argument for one-device runs.", stacklevel=2)
        if gpus:  # its input path is TensorFlow's own, not measured by tf_distrib
            return tf.distribute.get_strategy()
        strategy = HostOneDeviceStrategy(devices[0].name)
        _mark(strategy)  # gradient_accumulation_steps, as on every strategy
        return strategy
    names = [d.name for d in devices]
    if cross_device_ops is None and not gpus:
        cross_device_ops = tf.distribute.ReductionToOneDevice(reduce_to_device=names[0])
    # Compression inside the buckets: one cast per bucket instead of one per tensor.
    if compression is not None:
        cross_device_ops = cross_device.CompressedAllReduce(compression, inner=cross_device_ops)
    if bucket_bytes is not None:
        cross_device_ops = cross_device.BucketedAllReduce(bucket_bytes, inner=cross_device_ops)
    if gpus:
        strategy = tf.distribute.MirroredStrategy(names, cross_device_ops=cross_device_ops)
    else:
        strategy = HostMirroredStrategy(names, cross_device_ops=cross_device_ops)
    _mark(strategy)
    return strategy


def _mark(strategy, gradient_all_reduce=None) -> None:
    """Routes the Keras models and optimizers of a strategy from `make_strategy()` to
    tf_distrib (`optimizer_hooks`, `_step_function`)."""
    optimizer_hooks.mark(strategy, gradient_all_reduce)
    _step_function.mark(strategy)


def _connect_transport(strategy, spec, mode, connect_timeout, communication_timeout, prefix):
    """tf_distrib's transport for this worker's gradients, or None for TF's collective."""
    local = len(strategy.extended.worker_devices)
    gpus = bool(tf.config.list_physical_devices("GPU"))
    if mode == "tf" or (mode == "auto" and (gpus or local > 1)):
        return None
    if gpus or local > 1:
        raise ValueError(f"transport={mode!r} carries one CPU replica per worker; this worker "
                         f"has {local} {'GPU' if gpus else 'CPU'} replica(s). Use "
                         "transport='auto' or 'tf'.")
    tasks = spec.training_tasks
    secret = os.environ.get(contract.ENV_SECRET)
    try:
        carrier = transport_lib.connect(
            tasks.index(spec.task), tasks,
            spec.address.rpartition(":")[0], transport_lib.CoordinationServiceStore(),
            secret=secret.encode() if secret else None, mode="auto" if mode == "auto" else mode,
            timeout=min(connect_timeout, transport_lib.DEFAULT_CONNECT_TIMEOUT),
            peer_timeout=communication_timeout or transport_lib.DEFAULT_PEER_TIMEOUT,
            prefix=prefix)
    except transport_lib.TransportUnavailable as e:
        warnings.warn(f"tf_distrib: gradients go through TensorFlow's collective, since "
                      f"tf_distrib's transport is unavailable: {e}.", stacklevel=3)
        return None
    graph_op.prepare(carrier)
    atexit.register(carrier.close)
    return carrier


def _multi_worker_strategy(spec, communication_timeout, startup_timeout):
    implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL
                      if tf.config.list_physical_devices("GPU")
                      else tf.distribute.experimental.CommunicationImplementation.RING)
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=communication_timeout, implementation=implementation)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({role: list(a) for role, a in spec.cluster.items()}),
        task_type=spec.task_type, task_id=spec.task_index, rpc_layer="grpc",
        environment=spec.environment or "")
    with _exit_if_peers_missing(spec, startup_timeout):
        return KerasMultiWorkerMirroredStrategy(cluster_resolver=resolver,
                                                communication_options=options)


class _exit_if_peers_missing:
    """Watchdog around MWMS start-up, which blocks in C++ until every peer joins."""

    def __init__(self, spec, timeout):
        self._spec, self._timeout = spec, timeout
        self._done = threading.Event()

    def __enter__(self):
        if self._timeout != math.inf:
            threading.Thread(target=self._watch, name="tf_distrib-startup-watchdog",
                             daemon=True).start()

    def __exit__(self, *exc):
        self._done.set()

    def _watch(self):
        if self._done.wait(self._timeout):
            return
        missing = [a for role in cluster_lib.TRAINING_ROLES
                   for a in self._spec.cluster.get(role, ())
                   if not cluster_lib.is_listening(a, timeout=2)]
        sys.stderr.write(
            f"tf_distrib: task {self._spec.task} waited "
            f"{self._timeout:g} s for the cluster to start; not listening: "
            f"{missing or 'none (all ports open, but some task did not join)'}. Start "
            "every task with the same cluster, check their TF_CONFIG task indices and the "
            "firewall, or raise make_strategy(startup_timeout=...). Exiting with status "
            f"{STARTUP_TIMEOUT_EXIT_CODE}.\n")
        sys.stderr.flush()
        os._exit(STARTUP_TIMEOUT_EXIT_CODE)

