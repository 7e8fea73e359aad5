"""The transport as a TensorFlow op, run in the same order on every worker.

Each all-reduce is one stateful op (`tf.numpy_function`, or a native op: `native_sum` on
one host, `native_exchange` for small ones across hosts) bracketed by two updates of a
token variable of the transport: TensorFlow orders every op that touches one resource in
program order, so a step's collectives run one at a time in the order they were traced,
the same on every worker. Across hosts, `all_reduce_buckets` splits each bucket into a
start that hands it to the transport's thread and a finish that waits for its sum; every
finish waits for every start, so the network carries the first buckets while backward
computes the rest (`backward_order`).
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from tf_distrib.transport import backward_order
from tf_distrib.transport.collective import Transport
from tf_distrib.transport.sgd_step import SgdStep

# Transport -> its token variable.
_tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare(transport: Transport) -> None:
    """Creates the transport's token now (outside any strategy scope and tf.function)."""
    if transport not in _tokens:
        with tf.init_scope():
            _tokens[transport] = tf.Variable(0, dtype=tf.int64, trainable=False,
                                             name="tf_distrib_transport_token")


def all_reduce(transport: Transport, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """Sums `tensors` (one dtype, dense) across the workers of `transport`.

    Returns:
        One tensor per input, same shape and dtype, equal on every worker.
    """
    if not tensors:
        return []
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    native = _native_op(transport, tensors)
    if native is not None:
        return list(_ordered(transport, lambda ticket: native.all_reduce(ticket, tensors)))
    return _shaped(_ordered(transport, lambda ticket: tf.numpy_function(
        lambda number, *arrays: transport.all_reduce(list(arrays), seq=int(number)),
        [ticket, *tensors], [t.dtype for t in tensors], stateful=True,
        name="tf_distrib_all_reduce")), tensors)


def sgd(transport: Transport, step: SgdStep, gradients: list[tf.Tensor]):
    """Keras' SGD `step` on the sums of `gradients` (float32) across the workers, fused
    into the all-reduce by the transport's native op (`transport.native` must be set),
    which assigns the step's variables (this replica's; equal on every worker afterwards).

    Returns:
        The op (None when run eagerly).
    """
    return _ordered(transport, lambda ticket: transport.native.sgd(ticket, step, gradients))


def all_reduce_buckets(transport: Transport, buckets: list[list[tf.Tensor]]) -> list[list]:
    """`all_reduce` of each bucket, in order; across hosts the buckets travel while the
    ops that do not need their sums still run (see the module's docstring).

    Returns:
        The summed buckets, one list of tensors per bucket.
    """
    buckets = [[tf.convert_to_tensor(t) for t in bucket] for bucket in buckets]
    if not transport.overlaps or tf.executing_eagerly():
        return [all_reduce(transport, bucket) for bucket in buckets]
    tickets = [_ordered(transport, lambda ticket, bucket=bucket: tf.numpy_function(
        lambda number, *arrays: np.int64(transport.start(list(arrays), seq=int(number))),
        [ticket, *bucket], tf.int64, stateful=True, name="tf_distrib_all_reduce_start"))
        for bucket in buckets]
    backward_order.start_buckets_first(buckets, [ticket.op for ticket in tickets])
    with tf.control_dependencies(tickets):
        return [_shaped(tf.numpy_function(
            lambda number: transport.finish(int(number)), [ticket], [t.dtype for t in bucket],
            stateful=True, name="tf_distrib_all_reduce_finish"), bucket)
            for ticket, bucket in zip(tickets, buckets, strict=True)]


def _native_op(transport: Transport, tensors: list[tf.Tensor]):
    """The transport's native op that sums `tensors`, or None (the Python path's turn)."""
    if len({t.dtype for t in tensors}) != 1:
        return None
    if transport.native is not None and tensors[0].dtype.name in transport.native.DTYPES:
        return transport.native
    if transport.exchange is not None and transport.exchange.takes(tensors):
        return transport.exchange
    return None


def _ordered(transport: Transport, collective):
    """Runs `collective(ticket)` after the transport's previous collective op."""
    prepare(transport)
    token = _tokens[transport]
    outputs = collective(tf.convert_to_tensor(token.assign_add(1)))
    if not tf.executing_eagerly():
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            token.assign_add(0)  # the next collective op runs after this one has returned
    return outputs


def _shaped(outputs, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    if not isinstance(outputs, (list, tuple)):  # one output, run eagerly
        outputs = [outputs]
    for output, tensor in zip(outputs, tensors, strict=True):
        output.set_shape(tensor.shape)
    return list(outputs)
