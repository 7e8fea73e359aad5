"""`make_strategy()`: picks and configures the right tf.distribute strategy for Keras 3."""

from __future__ import annotations

import atexit
import itertools
import math
import os
import sys
import threading
import warnings

import tensorflow as tf

from tf_distrib import cluster as cluster_lib
from tf_distrib import contract, cross_device
from tf_distrib import transport as transport_lib
from tf_distrib.contract import ENV_STARTUP_TIMEOUT, STARTUP_TIMEOUT_EXIT_CODE
from tf_distrib.cross_device import gradients
from tf_distrib.health import phases, steps, timeline
from tf_distrib.health import watchdog as watchdog_lib
from tf_distrib.strategy import _step_function, optimizer_hooks
from tf_distrib.strategy.strategies import (
    HostMirroredStrategy,
    HostOneDeviceStrategy,
    KerasMultiWorkerMirroredStrategy,
)
from tf_distrib.transport import graph_op

_DEFAULT_STARTUP_TIMEOUT = 600.0
_MULTI_WORKER_STRATEGIES = itertools.count(1)


def make_strategy(cross_device_ops: tf.distribute.CrossDeviceOps | None = None, *,
                  compression: str | cross_device.PowerSGD | None = None,
                  bucket_bytes: int | None = None,
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
        compression: Gradient compression: "bf16", "fp16", "powersgd" (or a
            `cross_device.PowerSGD` with its knobs) or None. On MirroredStrategy
            it wraps the cross-device op in `cross_device.CompressedAllReduce` (inside
            the buckets, when there are buckets); on MWMS
            it compresses `model.fit`'s gradient all-reduce (metrics stay exact).
            PowerSGD, for workers on slow links, needs MWMS with tf_distrib's
            transport. Defaults to None.
        bucket_bytes: Pack gradients into buckets of at most this many bytes, one
            collective each, last layer first (`cross_device.BucketedAllReduce` on
            MirroredStrategy). Defaults to None: no buckets on MirroredStrategy; on MWMS
            the transport's own sizes (docs/gradients.md), else TF's single pack.
        transport: What carries MWMS's gradient all-reduce (`tf_distrib.transport`):
            "auto" (tf_distrib's transport for CPU workers of one replica each: shared
            memory on one host, shared memory within hosts and TCP rings between them,
            or a TCP ring; TensorFlow's collective otherwise), "tf" (TensorFlow's
            collective), "shm" or "tcp". Keras' logged values go through it too,
            uncompressed. If some worker cannot listen, every worker falls back to "tf"
            with a warning that says why. Defaults to None: TF_DISTRIB_TRANSPORT, else
            "auto".
        hang_timeout: Seconds without a finished step (training, evaluation or
            prediction) after which each MWMS worker writes a flight-recorder report
            and exits with status `contract.HUNG_EXIT_CODE` (76), instead of waiting
            forever for a stuck peer (`tf_distrib.health.watchdog`); it also bounds the
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

    Example:

    ```python
    strategy = td.make_strategy(compression="bf16")
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="mse")
    model.fit(dataset, epochs=3)
    ```
    """
    startup_timeout, hang_timeout, transport = _checked(
        cross_device_ops, compression, bucket_bytes, transport, hang_timeout,
        communication_timeout, startup_timeout)
    spec = cluster_lib.from_environment() if cluster is None else cluster
    # An evaluator is a side-car outside the collective: it evaluates on its own devices.
    if spec is not None and spec.num_workers > 1 and spec.task_type != "evaluator":
        if cross_device_ops is not None:
            raise ValueError(
                "MultiWorkerMirroredStrategy cannot use a custom cross_device_ops: it only "
                "runs TensorFlow's collective all-reduce. Drop cross_device_ops for "
                "multi-worker runs; compression= and bucket_bytes= apply to its gradients."
            )
        return _multi_worker(spec, compression, bucket_bytes, transport, hang_timeout,
                             communication_timeout, startup_timeout)
    return _local(cross_device_ops, compression, bucket_bytes)


def _checked(cross_device_ops, compression, bucket_bytes, transport, hang_timeout,
             communication_timeout, startup_timeout) -> tuple[float, float, str]:
    """Validates `make_strategy`'s arguments; the startup and hang timeouts and transport."""
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
    if _is_powersgd(compression) and transport == "tf":
        raise ValueError(_POWERSGD_TRANSPORT.format("transport='tf'"))
    if hang_timeout is None:
        hang_timeout = contract.env_seconds(contract.ENV_HANG_TIMEOUT,
                                            watchdog_lib.DEFAULT_HANG_TIMEOUT)
    if not hang_timeout > 0:
        raise ValueError(f"hang_timeout must be > 0 seconds, math.inf or None, got "
                         f"{hang_timeout!r}.")
    transport = transport or os.environ.get(contract.ENV_TRANSPORT) or "auto"
    if transport not in transport_lib.MODES:
        raise ValueError(f"transport must be one of {transport_lib.MODES}, got {transport!r}.")
    return startup_timeout, hang_timeout, transport


def _multi_worker(spec, compression, bucket_bytes, transport, hang_timeout,
                  communication_timeout, startup_timeout) -> KerasMultiWorkerMirroredStrategy:
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
    if strategy.transport is None and _is_powersgd(compression):
        raise ValueError(_POWERSGD_TRANSPORT.format(
            "this cluster runs TensorFlow's collective (GPUs, or several devices per worker)"))
    reduce = None
    if strategy.transport is not None or compression is not None or bucket_bytes is not None:
        reduce = gradients.GradientAllReduce(compression, bucket_bytes, strategy.transport)
    _mark(strategy, reduce)
    if hang_timeout != math.inf:
        strategy.start_watchdog(spec.task, hang_timeout, f"{keys}/hang")
    phases.enter(phases.BUILDING)
    return strategy


def _local(cross_device_ops, compression, bucket_bytes) -> tf.distribute.Strategy:
    """The strategy for this process's own devices: Mirrored, one device, or the default."""
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
                f"across devices{more}. Drop the argument for one-device runs.", stacklevel=3)
        if gpus:  # its input path is TensorFlow's own, not measured by tf_distrib
            return tf.distribute.get_strategy()
        strategy = HostOneDeviceStrategy(devices[0].name)
        _mark(strategy)  # gradient_accumulation_steps, as on every strategy
        return strategy
    if _is_powersgd(compression):
        raise ValueError(
            "compression='powersgd' compresses what workers send each other over a network; "
            "this process's devices share its memory, where it would only cost time. Use "
            "compression='bf16' (or None) for one host's devices; PowerSGD applies once the "
            "job runs as several workers (tf-distrib launch, TF_CONFIG).")
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


_POWERSGD_TRANSPORT = (
    "compression='powersgd' runs on tf_distrib's transport, and {}. Leave transport= at "
    "'auto' (or 'shm'/'tcp') with one CPU replica per worker, or use compression='bf16'.")


def _is_powersgd(compression) -> bool:
    return compression == "powersgd" or isinstance(compression, cross_device.PowerSGD)


def _mark(strategy, gradient_all_reduce=None) -> None:
    """Routes the Keras models and optimizers of a strategy from `make_strategy()` to
    tf_distrib (`optimizer_hooks`, `_step_function`)."""
    optimizer_hooks.mark(strategy, gradient_all_reduce)
    _step_function.mark(strategy)
    _record_steps(strategy)


def _record_steps(strategy) -> None:
    """Records the strategy's steps when the launcher asks: for `top`, for `--timeline`."""
    timeline_dir = os.environ.get(contract.ENV_TIMELINE_DIR)
    if not (os.environ.get(contract.ENV_STATUS_DIR) or timeline_dir):
        return
    recorder = steps.recorder_of(strategy, create=True)
    if timeline_dir:
        recorder.collecting = True
        atexit.register(timeline.write_part, recorder,
                        timeline.part_path(timeline_dir, recorder.worker))


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

