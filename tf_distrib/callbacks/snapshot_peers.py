"""Which in-memory snapshot a restarted job resumes from, and how a host without it gets it.

Data-parallel workers hold the same state, so every host's snapshot of a step is a
copy of every other host's: a host that lost its memory (a replaced machine) resumes
from a peer's snapshot. At a restart the workers tell each other (TensorFlow's
coordination service) which steps their hosts hold; the newest step that any host
holds wins, and when some host lacks it, the first worker that holds it sends it to
all in one all-reduce of its bytes (the others add zeros: the sum is its bytes, bit
for bit), over tf_distrib's transport where the strategy has one, else TensorFlow's
collective.
"""

from __future__ import annotations

import json

import numpy as np
import tensorflow as tf

from tf_distrib import _compat, cluster
from tf_distrib.callbacks.memory_snapshot import dtype_named
from tf_distrib.transport import graph_op


def gather(strategy, key: str, value: str, timeout: float) -> list[str]:
    """Every worker's `value` for `key`, in task order (this one's alone without
    a multi-worker strategy)."""
    if strategy is None:
        return [value]
    spec = cluster.spec_of(strategy)
    service = _compat.coordination_service()
    service.set_config_key_value(f"{key}/{spec.task}", value)
    values = []
    for task in spec.training_tasks:
        try:
            values.append(service.get_config_key_value(f"{key}/{task}", int(timeout * 1000)))
        except tf.errors.OpError as e:  # DeadlineExceededError, or the service went away
            raise TimeoutError(f"BackupAndRestore: {task} did not report its in-memory "
                               f"snapshots ({key}) within {timeout:g} s: {e}") from None
    return values


def newest(strategy, key: str, local_steps: list[int],
           timeout: float) -> tuple[int | None, list[bool]]:
    """(the newest step any worker's host holds, whether each worker's host holds it)."""
    held = [{int(step) for step in steps.split(",") if step}
            for steps in gather(strategy, key, ",".join(map(str, local_steps)), timeout)]
    step = max(set().union(*held), default=None)
    return step, [step in steps for steps in held]


def share(strategy, key: str, mine: tuple[dict, dict] | None, holders: list[bool],
          timeout: float) -> tuple[dict, dict[str, np.ndarray]]:
    """The first holder's snapshot, on every worker: `mine` is this worker's
    (manifest, arrays), or None where its host lacks the step."""
    source = holders.index(True)
    description = None
    if mine is not None:
        manifest, arrays = mine
        description = json.dumps({"manifest": manifest, "layout": [
            [name, value.dtype.name, list(value.shape)] for name, value in arrays.items()]})
    described = gather(strategy, f"{key}/description", description or "", timeout)
    received = json.loads(described[source])
    layout = [(name, dtype_named(dtype), shape) for name, dtype, shape in received["layout"]]
    size = sum(int(np.prod(shape)) * dtype.itemsize for _, dtype, shape in layout)
    blob = np.zeros(-(-size // 4) * 4, np.uint8)
    spec = cluster.spec_of(strategy)
    if mine is not None and spec.training_index == source:
        np.concatenate([value.reshape(-1).view(np.uint8) for value in mine[1].values()],
                       out=blob[:size])
    total = exact_sum(strategy, blob.view(np.int32), len(spec.training_tasks)).view(np.uint8)
    arrays, position = {}, 0
    for name, dtype, shape in layout:
        end = position + int(np.prod(shape)) * dtype.itemsize
        arrays[name] = total[position:end].view(dtype).reshape(shape)
        position = end
    return received["manifest"], arrays


def exact_sum(strategy, values: np.ndarray, workers: int) -> np.ndarray:
    """`values` (int32) summed over the workers: exact whatever the order; a collective."""
    transport = getattr(strategy, "transport", None)
    if transport is not None:
        [total] = graph_op.all_reduce(transport, [tf.constant(values)])
        return np.array(total)
    local_replicas = strategy.num_replicas_in_sync // workers

    @tf.function
    def first_local_replica_adds():
        context = tf.distribute.get_replica_context()
        mine = tf.constant(values)
        if local_replicas > 1:  # each worker's values once, not once per device
            first = context.replica_id_in_sync_group % local_replicas == 0
            mine = tf.where(first, mine, tf.zeros_like(mine))
        return context.all_reduce(tf.distribute.ReduceOp.SUM, mine)

    return np.array(strategy.experimental_local_results(
        strategy.run(first_local_replica_adds))[0])
