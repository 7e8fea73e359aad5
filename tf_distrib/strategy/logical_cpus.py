"""`use_logical_cpus`: one CPU split into several logical devices (laptops, tests)."""

from __future__ import annotations

import tensorflow as tf

from tf_distrib._checks import check_int


def use_logical_cpus(n: int) -> None:
    """Splits the host CPU into `n` logical devices, one replica each.

    Call it once at the top of the program, before TensorFlow creates any tensor,
    model or strategy. Calling it again with the same `n` does nothing.

    Args:
        n: Number of logical CPU devices, >= 1.

    Raises:
        ValueError: if `n` is not a positive integer.
        RuntimeError: if TensorFlow already initialised its devices with another
            layout; the message says how to fix it.

    Example:

    ```python
    td.use_logical_cpus(2)
    assert td.make_strategy().num_replicas_in_sync == 2
    ```
    """
    check_int("n", n)
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if len(current or [None]) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices("CPU"))
        raise RuntimeError(
            f"use_logical_cpus({n}) came too late: TensorFlow has already initialised "
            f"{have} CPU device(s). Call it first thing, right after `import tf_distrib`, "
            "before any tensor, model, dataset or strategy is created (in a notebook, "
            "restart the kernel and run it in the first cell)."
        ) from e
