"""State that differs between workers, in backups: one row per worker.

Data-parallel workers hold the same model, but what a compressed gradient all-reduce
keeps per worker (PowerSGD's error-feedback residuals) differs from worker to worker.
A backup holds every worker's row: the workers sum their state's bytes as integers,
each in its own row with zeros in the others' (exact, whatever the order), the chief
writes the rows, and on restore each worker takes its own row back.
"""

from __future__ import annotations

import numpy as np

from tf_distrib import cluster
from tf_distrib.callbacks import snapshot_peers
from tf_distrib.cross_device import gradients

PREFIX = "worker/"


def kept(strategy) -> bool:
    """Whether the strategy's gradient all-reduce keeps state of its own per worker."""
    reduce = gradients.of_strategy(strategy)
    return reduce is not None and reduce.powersgd is not None


def gather(strategy, optimizer) -> list[tuple[str, np.ndarray]]:
    """Every worker's state of `optimizer`'s model, stacked by worker: (name, rows) pairs;
    a collective."""
    if not kept(strategy):
        return []
    state = gradients.of_strategy(strategy).worker_state(gradients.state_owner(optimizer))
    spec = cluster.spec_of(strategy)
    workers, row = len(spec.training_tasks), spec.training_index
    sizes = [-(-value.nbytes // 4) * 4 for value in state.values()]
    blob = np.zeros((workers, sum(sizes)), np.uint8)
    position = 0
    for value, size in zip(state.values(), sizes, strict=True):
        blob[row, position:position + value.nbytes] = np.ravel(value).view(np.uint8)
        position += size
    total = snapshot_peers.exact_sum(strategy, blob.reshape(-1).view(np.int32), workers)
    total = total.view(np.uint8).reshape(workers, -1)
    rows, position = [], 0
    for (name, value), size in zip(state.items(), sizes, strict=True):
        part = total[:, position:position + value.nbytes]
        rows.append((PREFIX + name, part.copy().view(value.dtype).reshape(workers, *value.shape)))
        position += size
    return rows


def restore(strategy, optimizer, arrays: dict) -> None:
    """Gives each worker its row of `optimizer`'s model's state in a backup's `arrays` (if
    both have some)."""
    rows = {name[len(PREFIX):]: value for name, value in arrays.items()
            if name.startswith(PREFIX)}
    if rows and kept(strategy):
        gradients.of_strategy(strategy).load_worker_state(
            rows, cluster.spec_of(strategy).training_index, gradients.state_owner(optimizer))
