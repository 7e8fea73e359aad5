"""Helpers for testing distributed code: real worker processes, on 127.0.0.1 or on
simulated hosts (`SimulatedHosts`: network namespaces with their own addresses).

Example (in a pytest test):

```python
def train():
    import tf_distrib as td
    strategy = td.make_strategy()
    return strategy.num_replicas_in_sync

def test_two_workers():
    results = tf_distrib.testing.run_workers(train, num_workers=2)
    assert [r.value for r in results] == [2, 2]
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tf_distrib.launch import WorkerResult, launch
from tf_distrib.testing.simulated_hosts import SimulatedHosts

__all__ = ["run_workers", "WorkersFailed", "SimulatedHosts"]


class WorkersFailed(RuntimeError):
    """A worker of `run_workers` failed; the message has its status and last lines.

    Example:

    ```python
    try:
        run_workers(train, 2)
    except WorkersFailed as e:
        print(e.workers[0].exit_code)
    ```
    """

    def __init__(self, message: str, workers: list[WorkerResult]):
        super().__init__(message)
        self.workers = workers


def run_workers(target: str | Callable, num_workers: int = 2, *, args: Sequence = (),
                kwargs: Mapping | None = None, check: bool = True,
                **options) -> list[WorkerResult]:
    """Runs `target` once in `num_workers` real processes with TF_CONFIG on 127.0.0.1.

    Every worker is stopped when one fails or the launch's `timeout` passes (SIGTERM,
    then SIGKILL: MultiWorkerMirroredStrategy ignores SIGTERM), so a test never hangs
    and never leaves processes behind.

    Args:
        target: A function (its return value comes back in `WorkerResult.value`),
            a script path, or "-m module".
        num_workers: Number of worker processes. Defaults to 2.
        args: Arguments of the function, or of the script. Defaults to ().
        kwargs: Keyword arguments of the function. Defaults to None.
        check: Raise `WorkersFailed` unless every worker exits with 0. Defaults to True.
        **options: `tf_distrib.launch.LaunchConfig` fields, e.g. `quiet=True`; unlike
            `launch()`'s, `timeout` defaults to 300 s: a test must always end.

    Returns:
        One `WorkerResult` per worker (index, exit_code, output, value).

    Example:

    ```python
    def train():
        import tf_distrib as td
        return td.make_strategy().num_replicas_in_sync

    assert [w.value for w in run_workers(train, 2, quiet=True)] == [2, 2]
    ```
    """
    options.setdefault("timeout", 300.0)
    result = launch(target, num_workers, args=args, kwargs=kwargs, **options)
    if check and result.exit_code != 0:
        raise WorkersFailed(result.failure_report(), result.workers)
    return result.workers
