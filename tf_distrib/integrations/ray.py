"""Run a tf_distrib training function on Ray Train's `TensorflowTrainer`.

Ray gives each worker actor a TF_CONFIG and, with `max_failures=N`, restarts the whole
group after a worker dies; `BackupAndRestore` on the run's storage (`backup_dir()`)
resumes where it stopped. Needs `pip install "tf_distrib[ray]"`.
Example:

```python
def train(config):
    strategy = td.make_strategy()          # MWMS from Ray's TF_CONFIG
    ...
    model.fit(dataset, callbacks=[td.callbacks.BackupAndRestore(td_ray.backup_dir())])

td_ray.make_trainer(train, num_workers=2, max_failures=1, storage_path="/runs").fit()
```
"""

from __future__ import annotations

import functools
import inspect
import os
import posixpath
from collections.abc import Callable, Mapping

try:
    import ray.train
    from ray.train.tensorflow import TensorflowTrainer
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"tf_distrib.integrations.ray needs Ray Train ({e}). Install it with "
        "`pip install \"tf_distrib[ray]\"`."
    ) from e

from tf_distrib import _compat
from tf_distrib._checks import check_int
from tf_distrib.contract import ENV_NUM_WORKERS, ENV_WORKER_INDEX

__all__ = ["make_trainer", "prepare_worker", "run_dir", "backup_dir"]

# tf.io.gfile scheme of each pyarrow filesystem Ray may store a run on.
_GFILE_SCHEMES = {"local": "", "gcs": "gs://", "s3": "s3://"}


def prepare_worker() -> None:
    """Makes this Ray Train worker ready for tf_distrib; call it first in the loop.

    `make_trainer` calls it for you. It undoes Ray's `TF_USE_LEGACY_KERAS=1` (set for
    Keras 2; with it `tf.keras` fails or is not the Keras 3 tf_distrib trains) and sets
    `TF_DISTRIB_WORKER_INDEX` / `TF_DISTRIB_NUM_WORKERS` from Ray's ranks, as
    `tf-distrib launch` does, so the same script runs under both.
    """
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    context = ray.train.get_context()
    os.environ[ENV_WORKER_INDEX] = str(context.get_world_rank())
    os.environ[ENV_NUM_WORKERS] = str(context.get_world_size())


def run_dir() -> str:
    """This Ray Train run's directory on its storage, as a tf.io.gfile path.

    That is `RunConfig(storage_path=...)/<run name>`, shared by every worker and kept
    across restarts of the worker group: the place for backups and the final model.

    Raises:
        ValueError: when the storage is a filesystem TensorFlow cannot write (only
            local or shared paths, gs:// and s3:// map to TensorFlow paths).
        RuntimeError: (from Ray) outside a Ray Train training function.
    """
    return _gfile_path(*_compat.ray_run_storage(ray.train.get_context()))


def _gfile_path(filesystem: str, path: str) -> str:
    if filesystem not in _GFILE_SCHEMES:
        raise ValueError(
            f"Ray stores this run on a '{filesystem}' filesystem, which has no "
            "tf.io.gfile path. Use a local or shared path, gs:// or s3:// as "
            "RunConfig(storage_path=...), or give BackupAndRestore a directory yourself."
        )
    return _GFILE_SCHEMES[filesystem] + path


def backup_dir(name: str = "tf_distrib_backup") -> str:
    """A directory for `callbacks.BackupAndRestore` on the run's storage.

    Every worker of the run and every restarted worker group gets the same path, so
    a group that Ray restarts resumes from the last backup.

    Args:
        name: Subdirectory of `run_dir()`. Defaults to "tf_distrib_backup".
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"backup_dir name must be a non-empty folder name, got {name!r}.")
    return posixpath.join(run_dir(), name)


def make_trainer(train_fn: Callable, *, num_workers: int | tuple[int, int] = 2,
                 cpus_per_worker: float = 1,
                 use_gpu: bool = False, max_failures: int = 0,
                 storage_path: str | None = None, name: str | None = None,
                 config: Mapping | None = None) -> TensorflowTrainer:
    """A Ray Train `TensorflowTrainer` that runs `train_fn` in every worker.

    Args:
        train_fn: The training function: no argument, or one (the `config` dict).
            It runs after `prepare_worker()`; Ray discards its return value.
        num_workers: Ray actors, one MultiWorkerMirroredStrategy worker each, or
            (min, max) for an elastic run: Ray Train starts with as many workers as
            the cluster has resources for (at least min), and restarts the group at
            another size when workers are lost or resources appear; BackupAndRestore
            and distribute_dataset resume exactly across the change, with the same
            global batch. Defaults to 2.
        cpus_per_worker: CPUs Ray reserves per worker. Defaults to 1.
        use_gpu: Reserve one GPU per worker. Defaults to False.
        max_failures: How many times Ray restarts the worker group after a worker
            fails (-1: without limit). Defaults to 0.
        storage_path: Where Ray keeps the run (a path every node shares, gs://, s3://).
            Defaults to None: Ray's default, ~/ray_results, fine on one machine.
        name: The run's name, its folder under `storage_path`. Use the same name to
            resume a run. Defaults to None: a new name from Ray.
        config: Passed to `train_fn`. Defaults to None: an empty dict.

    Returns:
        The trainer; `trainer.fit()` runs it and raises if the run fails.

    Example:

    ```python
    trainer = td_ray.make_trainer(train, num_workers=2, max_failures=1,
                                  storage_path="/shared/runs", config={"epochs": 3})
    result = trainer.fit()
    ```
    """
    if not callable(train_fn):
        raise TypeError(f"train_fn must be callable, got {type(train_fn).__name__}.")
    takes_config = bool(inspect.signature(train_fn).parameters)
    if isinstance(num_workers, tuple):
        if len(num_workers) != 2:
            raise ValueError(f"num_workers must be an int or (min, max), got {num_workers!r}.")
        check_int("num_workers' min", num_workers[0], minimum=1)
        check_int("num_workers' max", num_workers[1], minimum=num_workers[0])
    else:
        check_int("num_workers", num_workers, minimum=1)
    check_int("max_failures", max_failures, minimum=-1)
    if (isinstance(cpus_per_worker, bool) or not isinstance(cpus_per_worker, (int, float))
            or not cpus_per_worker > 0):
        raise ValueError(f"cpus_per_worker must be a number > 0, got {cpus_per_worker!r}.")
    resources = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    return TensorflowTrainer(
        functools.partial(_run_worker, train_fn, takes_config),
        train_loop_config=dict(config or {}),
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=max_failures)),
    )


def _run_worker(train_fn: Callable, takes_config: bool, config: dict) -> None:
    prepare_worker()
    if takes_config:
        train_fn(config)
    else:
        train_fn()
