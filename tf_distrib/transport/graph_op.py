"""The transport as a TensorFlow op, run in the same order on every worker.

Each all-reduce is one stateful `tf.numpy_function`, bracketed by two updates of a
token variable that belongs to the transport. Inside a `tf.function`, TensorFlow
orders every op that touches one resource in program order, through `tf.cond` and
`tf.while_loop` bodies too, so the collectives of a step run one at a time, in the
order they were traced: the same order on every worker, while each one still starts
as soon as its own inputs exist (the first gradient bucket travels while backward
computes the rest). The token's value numbers the collective.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tf_distrib.transport.collective import Transport

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
    prepare(transport)
    token = _tokens[transport]
    ticket = tf.convert_to_tensor(token.assign_add(1))
    outputs = tf.numpy_function(
        lambda number, *arrays: transport.all_reduce(list(arrays), seq=int(number)),
        [ticket, *tensors], [t.dtype for t in tensors], stateful=True,
        name="tf_distrib_all_reduce")
    if not isinstance(outputs, (list, tuple)):  # one output, run eagerly
        outputs = [outputs]
    if not tf.executing_eagerly():
        with tf.control_dependencies(outputs):
            token.assign_add(0)  # the next collective starts after this one has finished
    for output, tensor in zip(outputs, tensors, strict=True):
        output.set_shape(tensor.shape)
    return list(outputs)
