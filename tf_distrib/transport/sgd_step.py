"""Keras' `SGD` update as the fused all-reduces receive it (`graph_op.sgd`, PowerSGD's).

`optimizer_hooks` routes `SGD.update_step` here in replica context: the transport's
native ops sum the gradients and take the step in one pass, and what they cannot take is
`SgdStep.apply`, Keras' own arithmetic op for op, so the variables get Keras' bits.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class SgdStep:
    """Keras' `SGD` update of some variables, with the tensors it needs.

    Args:
        learning_rate: The step's learning rate (a float32 scalar).
        variables: The `tf.Variable`s (this replica's), one per gradient.
        momentum: The momentum (a float32 scalar), with `velocities`. Defaults to None.
        velocities: The momentum's `tf.Variable`s, one per gradient. Defaults to None.
        nesterov: Nesterov's momentum. Defaults to False.
    """

    learning_rate: tf.Tensor
    variables: list
    momentum: tf.Tensor | None = None
    velocities: list | None = None
    nesterov: bool = False

    def apply(self, sums: list[tf.Tensor], indices):
        """Keras' `SGD.update_step` on `sums` for the variables at `indices`, op for op
        (the same bits), on the variables' handles: in replica context, where Keras would
        need its cross-replica `update`.

        Returns:
            The step's op.
        """
        ops = []
        for g, i in zip(sums, indices, strict=True):
            weights, descent = self.variables[i].handle, g * self.learning_rate
            if self.velocities is None:
                ops.append(tf.raw_ops.AssignSubVariableOp(resource=weights, value=descent))
                continue
            velocity = self.velocities[i].handle
            new = read_float32(velocity) * self.momentum - descent
            with tf.control_dependencies([tf.raw_ops.AssignVariableOp(resource=velocity,
                                                                      value=new)]):
                new = read_float32(velocity)
                value = new * self.momentum - descent if self.nesterov else new
                ops.append(tf.raw_ops.AssignAddVariableOp(resource=weights, value=value))
        with tf.control_dependencies(ops):
            return tf.constant(True)


def read_float32(handle) -> tf.Tensor:
    """A float32 resource variable's value, read through its handle (the native ops take
    handles, not Keras' variables)."""
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
