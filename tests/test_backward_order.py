"""Across hosts, each gradient bucket starts before backward computes the later ones."""

import numpy as np
import tensorflow as tf

from tf_distrib.transport import backward_order


def _recorder(events, name):
    def record(*arrays):
        events.append(name)
        return np.int64(len(events))
    return record


def _two_layers():
    x = tf.constant(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    return x, tf.Variable(tf.fill([4, 8], 0.1)), tf.Variable(tf.fill([8, 2], 0.2))


def test_ops_only_later_buckets_need_wait_for_the_earlier_start():
    x, w1, w2 = _two_layers()
    events, delayed, forks, kernel_gradient = [], [], [], []

    def step(reorder: bool):
        with tf.GradientTape() as tape:
            hidden = tf.nn.relu(x @ w1)
            loss = tf.reduce_sum(tf.square(hidden @ w2))
        g1, g2 = tape.gradient(loss, [w1, w2])
        buckets = [[g2], [g1]]  # the last layer's first, as backward computes them
        starts = [tf.numpy_function(_recorder(events, f"start {i}"), bucket, tf.int64,
                                    stateful=True) for i, bucket in enumerate(buckets)]
        if reorder:
            delayed.append(backward_order.start_buckets_first(
                buckets, [s.op for s in starts]))
            forks.extend(op for op in starts[0].graph.get_operations()
                         if starts[0].op in op.control_inputs)
            kernel_gradient.append(g2.op)
        with tf.control_dependencies(starts):
            return tf.identity(g1), tf.identity(g2)

    reordered = tf.function(lambda: step(True))()
    plain = tf.function(lambda: step(False))()
    # Backward forks where the hidden layer's output gradient feeds both the second
    # kernel's gradient (bucket 0) and the hidden layer's gradient (bucket 1): the latter
    # branch (its MatMul, then ReluGrad) now waits for bucket 0's start.
    assert delayed[0] >= 1
    assert "MatMul" in {op.type for op in forks}
    assert kernel_gradient[0] not in forks  # what bucket 0 needs never waits
    for a, b in zip(reordered, plain, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # the order only


def test_the_later_branch_runs_after_the_earlier_bucket_started():
    events = []
    upstream = tf.constant(np.ones((8, 2), np.float32))
    x, w1, _ = _two_layers()

    @tf.function
    def step():
        early = upstream * 2.0  # bucket 0's gradient
        # The branch towards bucket 1 forks off the same tensor, stateless.
        later = tf.numpy_function(_recorder(events, "later branch"), [upstream], tf.int64,
                                  stateful=False)
        late = tf.cast(later, tf.float32) * tf.reduce_sum(x @ w1)  # bucket 1's gradient
        starts = [tf.numpy_function(_recorder(events, f"start {i}"), [g], tf.int64,
                                    stateful=True) for i, g in enumerate([early, late])]
        assert backward_order.start_buckets_first([[early], [late]],
                                                  [s.op for s in starts]) == 1
        return starts

    for _ in range(5):
        events.clear()
        step()
        assert events.index("start 0") < events.index("later branch") < events.index("start 1")


def test_a_fork_that_a_stateful_op_needs_is_left_alone():
    events = []
    upstream = tf.constant(np.ones(4, np.float32))

    @tf.function
    def step():
        early = upstream * 2.0
        later = upstream + 1.0  # the fork towards bucket 1
        # A stateful op made before the starts that depends on the fork: TensorFlow
        # chains it before the start ops, so an edge start 0 -> fork would be a cycle.
        seen = tf.numpy_function(_recorder(events, "stateful"), [later], tf.int64,
                                 stateful=True)
        late = later * 3.0
        starts = [tf.numpy_function(_recorder(events, f"start {i}"), [g], tf.int64,
                                    stateful=True) for i, g in enumerate([early, late])]
        assert backward_order.start_buckets_first([[early], [late]],
                                                  [s.op for s in starts]) == 0
        return [seen, *starts]

    step()  # no cycle
    assert events == ["stateful", "start 0", "start 1"]


def test_nothing_to_order_eagerly_or_with_one_bucket():
    tensor = tf.constant([1.0])
    assert backward_order.start_buckets_first([[tensor], [tensor]], [None, None]) == 0

    @tf.function
    def one_bucket():
        start = tf.numpy_function(lambda a: np.int64(0), [tensor * 2.0], tf.int64)
        assert backward_order.start_buckets_first([[tensor]], [start.op]) == 0
        return start

    one_bucket()
