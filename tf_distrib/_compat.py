"""Every touch of TensorFlow, Keras or Ray internals, in one place, each checked when used.

tf_distrib fixes upstream bugs and fills gaps from outside, which takes private names.
A release of TensorFlow, Keras or Ray may rename one; each accessor here then raises
`CompatibilityError` naming the library, its version, the missing name and the
tf_distrib feature that needs it, instead of letting a fix go silently inert.
`check()` tries them all (`tf-distrib doctor` and the tests run it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types

# The versions tf_distrib's tests run on (the constraints file pins them for CI).
TESTED = "TensorFlow 2.21, Keras 3.15, Ray 2.60"


class CompatibilityError(RuntimeError):
    """An internal name tf_distrib relies on is missing from the installed library."""


def _version(package: str) -> str:
    for name in (package, f"{package}-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(not installed)"


def _require(owner, name: str, feature: str, package: str):
    """`owner.name`, or CompatibilityError naming the version and the feature."""
    if isinstance(owner, str):
        owner = importlib.import_module(owner)
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__name__", type(owner).__name__)
        raise CompatibilityError(
            f"tf_distrib's {feature} needs {where}.{name}, which {package} "
            f"{_version(package)} does not have. tf_distrib is tested with {TESTED}: install "
            f"those versions, or a tf_distrib release that supports {package} "
            f"{_version(package)}.") from None


def _patch(owner, name: str, make_replacement, feature: str, package: str) -> None:
    """Replaces `owner.name` with `make_replacement(original)`, once (idempotent)."""
    original = _require(owner, name, feature, package)
    if getattr(original, "_tf_distrib", False):
        return
    replacement = make_replacement(original)
    replacement._tf_distrib = True
    setattr(owner, name, replacement)


# TensorFlow ---------------------------------------------------------------------------

def use_trace_time_collective_keys() -> None:
    """Makes TF's collectives take their instance keys when traced (process-wide).

    TF defers them to call time (`capture_call_time_value`), which does not reach
    through a `tf.cond` inside a `tf.while_loop`: Keras' `steps_per_execution > 1`
    then fails under MWMS (keras-team/keras#19246), and so do collectives in a cond.
    """
    from tensorflow.python.distribute import cross_device_utils

    launcher = _require(cross_device_utils, "CollectiveReplicaLauncher",
                        "compile(steps_per_execution>1) under MWMS", "tensorflow")
    _require(launcher, "_prefer_unique_instance_key",
             "compile(steps_per_execution>1) under MWMS", "tensorflow")
    launcher._prefer_unique_instance_key = False


def per_replica(components):
    """A tf.distribute PerReplica value from one tensor per local device."""
    from tensorflow.python.distribute import values

    return _require(values, "PerReplica", "cross-device ops", "tensorflow")(tuple(components))


def mirrored(components):
    """A tf.distribute Mirrored value from one (equal) tensor per local device."""
    from tensorflow.python.distribute import distribute_utils, values

    regroup = _require(distribute_utils, "regroup", "cross-device ops", "tensorflow")
    return regroup(tuple(components),
                   wrap_class=_require(values, "Mirrored", "cross-device ops", "tensorflow"))


def canonical_device(device: str) -> str:
    from tensorflow.python.distribute import device_util

    return _require(device_util, "canonicalize", "cross-device ops", "tensorflow")(device)


def devices_of(destinations) -> tuple[str, ...]:
    """The devices a tf.distribute `destinations` argument names."""
    from tensorflow.python.distribute import cross_device_ops

    return _require(cross_device_ops, "get_devices_from", "cross-device ops",
                    "tensorflow")(destinations)


def wrap_device_buffers(wrap) -> None:
    """Passes each per-device buffer dataset TF's MultiDeviceIterator builds through `wrap`."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    _patch(multi_device_iterator_ops, "_create_device_dataset",
           lambda create: lambda *a, **k: wrap(create(*a, **k)),
           "distribute_dataset's iterator-stall fix", "tensorflow")


def iterate_with_plain_iterators(dataset) -> None:
    """Gives a distributed dataset plain tf.data iterators, for workers of one CPU device.

    TF gives each worker a MultiDeviceIterator, which wraps the worker's dataset in a
    new `with_options` dataset every time one is made, so tf.data's graph rewrites run
    again for each iterator instead of once per dataset (tf.data caches them on the
    dataset). Keras makes two iterators per epoch of a finite dataset, and the rewrite
    takes time in proportion to the data held in memory: 0.23 s of CPU for a 160 MB
    `from_tensor_slices` (TF 2.21), 0.002 s once cached. With one device per worker,
    per-worker input is per-replica input, and TF's own iterators for
    `InputReplicationMode.PER_REPLICA` without a device copy are plain `iter(dataset)`.
    The MultiDeviceIterator's one-batch buffer goes with it; a pipeline that does not end
    in `prefetch` gets one from tf.data's `inject_prefetch` while autotuning is on (the
    default), and `distribute_dataset`'s end in one.
    """
    import tensorflow as tf
    from tensorflow.python.distribute import input_lib

    feature = "the input iterators of one-CPU workers"
    _require(input_lib, "_should_use_multi_device_iterator", feature, "tensorflow")
    _require(dataset, "_options", feature, "tensorflow")
    dataset._options = tf.distribute.InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)


def set_distributed_cardinality(dataset, steps: int) -> None:
    """Sets what Keras reads as a distributed dataset's number of steps."""
    _require(dataset, "_cardinality", "distribute_dataset's step count", "tensorflow")
    dataset._cardinality = steps


def distributed_cardinality(dataset) -> int | None:
    """The step count TF's DistributedDatasetsFromFunction reports, None if it has none."""
    return getattr(dataset, "_cardinality", None)


def dataset_inputs(dataset) -> list | None:
    """The datasets a tf.data dataset reads from; None where TensorFlow does not say."""
    inputs = getattr(dataset, "_inputs", None)
    return None if inputs is None else list(inputs())


def dataset_batch_size(dataset) -> int | None:
    """The batch size of a tf.data `batch()` dataset; None where TensorFlow does not say."""
    size = getattr(dataset, "_batch_size", None)
    return None if size is None else int(size)


def skip_partial_batch_checks(dataset) -> None:
    """Stops a distributed dataset's iterators from all-reducing "has data" every step.

    Under MWMS, TF checks with a collective at every step that every worker still has
    data (`get_next_as_optional`), in case one pipeline ends early.
    """
    _require(dataset, "_enable_get_next_as_optional", "distribute_dataset's equal steps",
             "tensorflow")
    dataset._enable_get_next_as_optional = False


def add_control_input(op, before) -> None:
    """Makes graph op `op` run after op `before` (a control edge), while tracing."""
    _require(op, "_add_control_input", "the early start of gradient buckets across hosts",
             "tensorflow")(before)


def coordination_service():
    """The eager context, which speaks to TF's coordination service (its key-value store)."""
    from tensorflow.python.eager import context

    ctx = context.context()
    for name in ("set_config_key_value", "get_config_key_value"):
        _require(ctx, name, "multi-worker rendezvous (preemption, transport, watchdog)",
                 "tensorflow")
    return ctx


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is in force."""
    from tensorflow.python.framework import config

    return _require(config, "is_op_determinism_enabled", "step timing (input wait)",
                    "tensorflow")()


def in_multi_worker_mode(strategy) -> bool:
    """Whether `strategy` (a MultiWorkerMirroredStrategy) spans several workers."""
    return _require(strategy.extended, "_in_multi_worker_mode", "multi-worker detection",
                    "tensorflow")()


# Keras ----------------------------------------------------------------------------------

def optimizer_class():
    """Keras' TensorFlow optimizer base class (whose methods tf_distrib routes)."""
    from keras.src.backend.tensorflow import optimizer

    return _require(optimizer, "TFOptimizer", "the gradient path", "keras")


def patch_trainer(name: str, make_replacement, feature: str) -> None:
    """Replaces Keras' `TensorFlowTrainer.<name>` with `make_replacement(original)`
    (idempotent)."""
    from keras.src.backend.tensorflow import trainer

    _patch(_require(trainer, "TensorFlowTrainer", feature, "keras"), name, make_replacement,
           feature, "keras")


def keras_reduce_per_replica():
    """Keras' reduction of a step's per-replica outputs to its logs."""
    from keras.src.backend.tensorflow import trainer

    return _require(trainer, "reduce_per_replica", "the direct step function", "keras")


def patch_optimizer(name: str, make_replacement, feature: str) -> None:
    """Replaces `TFOptimizer.<name>` with `make_replacement(original)` (idempotent).

    The replacements only act for optimizers whose strategy came from `make_strategy`
    and call the original for every other one.
    """
    _patch(optimizer_class(), name, make_replacement, feature, "keras")


# What gradient accumulation under a strategy uses of a Keras optimizer: Keras' own
# update step, in the order its BaseOptimizer runs it.
_ACCUMULATION_INTERNALS = ("_accumulated_gradients", "_get_variable_index", "_iterations",
                           "_clip_gradients", "_apply_weight_decay", "_backend_update_step",
                           "_backend_reset_gradient_accumulators")


def optimizer_strategy(optimizer):
    """The tf.distribute strategy a Keras TF optimizer was created under."""
    return _require(optimizer, "_distribution_strategy", "the gradient path", "keras")


def variable_index(optimizer):
    """Keras' `optimizer._get_variable_index`: a variable's place in its slot lists."""
    return _require(optimizer, "_get_variable_index", "the fused SGD step", "keras")


def accumulation_internals(optimizer) -> types.SimpleNamespace:
    """The Keras optimizer internals gradient accumulation uses, as attributes."""
    feature = "gradient_accumulation_steps under make_strategy()"
    return types.SimpleNamespace(**{name.lstrip("_"): _require(optimizer, name, feature, "keras")
                                    for name in _ACCUMULATION_INTERNALS})


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes `fit` (which reads it right after on_train_begin) start at `epoch`."""
    _require(model, "_initial_epoch", "BackupAndRestore's resume", "keras")
    model._initial_epoch = epoch


def build_for_data(model, element_spec) -> None:
    """Builds an unbuilt model, optimizer and metrics from the data's spec, as fit would."""
    metrics = _require(model, "_compile_metrics", "BackupAndRestore's resume", "keras")
    if (not model.built or not model.optimizer.built
            or (metrics is not None and not metrics.built)):
        _require(model, "_symbolic_build", "BackupAndRestore's resume", "keras")(
            data_batch=element_spec)


def compute_loss(model, **kwargs):
    """Keras' own loss computation (compiled loss plus regularisers), for train steps."""
    return _require(model, "_compute_loss", "model_parallel's micro-batches", "keras")(**kwargs)


def loss_tracker(model):
    """The metric that holds a model's logged "loss"."""
    return _require(model, "_loss_tracker", "model_parallel's micro-batches", "keras")


# Ray ------------------------------------------------------------------------------------

def ray_run_storage(context) -> tuple[str, str]:
    """(filesystem type, path) of a Ray Train run's storage."""
    storage = _require(context, "get_storage", "the Ray integration's run_dir()", "ray")()
    filesystem = _require(storage, "storage_filesystem", "the Ray integration's run_dir()",
                          "ray")
    return (_require(filesystem, "type_name", "the Ray integration's run_dir()", "ray"),
            _require(storage, "experiment_fs_path", "the Ray integration's run_dir()", "ray"))


# Names looked up on modules and classes (instance attributes are checked when used).
_STATIC = [
    ("tensorflow", "tensorflow.python.distribute.cross_device_utils",
     "CollectiveReplicaLauncher._prefer_unique_instance_key"),
    ("tensorflow", "tensorflow.python.distribute.values", "PerReplica"),
    ("tensorflow", "tensorflow.python.distribute.values", "Mirrored"),
    ("tensorflow", "tensorflow.python.distribute.distribute_utils", "regroup"),
    ("tensorflow", "tensorflow.python.distribute.device_util", "canonicalize"),
    ("tensorflow", "tensorflow.python.distribute.cross_device_ops", "get_devices_from"),
    ("tensorflow", "tensorflow.python.data.ops.multi_device_iterator_ops",
     "_create_device_dataset"),
    ("tensorflow", "tensorflow.python.distribute.input_lib", "_should_use_multi_device_iterator"),
    ("tensorflow", "tensorflow.python.eager.context", "context"),
    ("tensorflow", "tensorflow.python.data.ops.dataset_ops", "DatasetV2._inputs"),
    ("tensorflow", "tensorflow.python.framework.ops", "Operation._add_control_input"),
    ("tensorflow", "tensorflow.python.framework.config", "is_op_determinism_enabled"),
    ("keras", "keras", "Model._symbolic_build"),
    ("keras", "keras", "Model._compute_loss"),
    ("keras", "keras", "optimizers.SGD.update_step"),
    *[("keras", "keras.src.backend.tensorflow.trainer", name)
      for name in ("TensorFlowTrainer._make_function", "reduce_per_replica")],
    *[("keras", "keras.src.backend.tensorflow.optimizer", f"TFOptimizer.{name}")
      for name in ("_all_reduce_sum_gradients", "_backend_apply_gradients",
                   *(n for n in _ACCUMULATION_INTERNALS if n not in (
                       "_accumulated_gradients", "_iterations")))],
]


def check() -> list[str]:
    """Looks up every module- and class-level internal tf_distrib uses; the missing ones."""
    problems = []
    for package, module, path in _STATIC:
        try:
            owner = importlib.import_module(module)
            for name in path.split("."):
                owner = _require(owner, name, "tf_distrib", package)
        except (CompatibilityError, ImportError) as e:
            problems.append(str(e))
    return problems


def local_value(variable):
    """A view of this worker's copy of a Keras variable's value, read without a collective.

    Keras 3 keeps the TensorFlow variable in `_value`; a mirrored variable keeps this
    worker's first copy in `_primary`. `tf.convert_to_tensor(variable.value)` reads the
    same through the distribution layer at ~0.25 ms a variable, 10x more.
    """
    import numpy as np

    inner = getattr(variable, "_value", variable)
    inner = getattr(inner, "_primary", inner)
    return np.asarray(inner.read_value())


def assign_local(variable, value) -> None:
    """Assigns this worker's copy of a variable (a SyncOnRead one's, without the division
    by the number of replicas that an assignment in cross-replica context makes)."""
    getattr(variable, "_primary", variable).assign(value)
