"""Across hosts, backward hands each gradient bucket over before it computes the rest.

TensorFlow's executor does not favour a bucket's start op: where backward forks (a dense
layer's output gradient feeds its kernel's gradient and its input's), a worker with one
inter-op thread ran the input's branch first and the kernel's gradient last, so almost
none of a bucket's time on the link hid behind computation. `start_buckets_first` makes
every op where backward forks off towards later buckets wait for the earlier bucket's
start (a control edge). Only the order changes, never a value. Only stateless ops that
no earlier bucket needs wait, and none that a stateful op made before the start ops
depends on (TensorFlow's `auto_control_deps` chain would make that edge a cycle).
"""

from __future__ import annotations

import tensorflow as tf

from tf_distrib import _compat


def start_buckets_first(buckets: list[list[tf.Tensor]], starts: list[tf.Operation]) -> int:
    """Makes the ops that only later buckets need wait for each earlier bucket's start.

    Args:
        buckets: The tensors each start op sends, in the order the buckets start.
        starts: Each bucket's start op (same graph, inside a `tf.function` being traced).

    Returns:
        How many ops were made to wait (0 when run eagerly, across graphs, or with one
        bucket).
    """
    if len(buckets) < 2 or tf.executing_eagerly():
        return 0
    graph = starts[0].graph
    if any(t.graph is not graph for bucket in buckets for t in bucket):
        return 0  # e.g. gradients captured into a tf.cond branch: leave the order alone
    needs = [_ancestors([t.op for t in bucket]) for bucket in buckets]
    # TensorFlow chains stateful ops in the order they were made once the trace ends: an
    # edge from a start op to a fork closes a cycle only if a stateful op made before
    # the starts depends on that fork (ops are listed in the order they were made).
    operations = graph.get_operations()
    made_before = operations[:operations.index(starts[0])]
    protected = _ancestors([op for op in made_before if _stateful(op)])
    after = [set()]  # after[k]: what the last k buckets need
    for bucket_needs in reversed(needs[1:]):
        after.append(after[-1] | bucket_needs)
    delayed = 0
    earlier: set = set()
    for i in range(len(buckets) - 1):
        earlier |= needs[i]
        later = after[len(buckets) - 1 - i] - earlier - protected
        forks = {consumer for op in needs[i] for output in op.outputs
                 for consumer in output.consumers()
                 if consumer in later and not _stateful(consumer)}
        for op in forks:
            _compat.add_control_input(op, starts[i])
        delayed += len(forks)
    return delayed


def _stateful(op) -> bool:
    try:
        return op.op_def.is_stateful
    except (AttributeError, ValueError):
        return True  # no registered definition: assume the worst


def _ancestors(ops) -> set:
    """`ops` and every op they depend on (data or control), within their graph."""
    seen, stack = set(ops), list(ops)
    while stack:
        op = stack.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen
