"""Shared set-up: the pytest process itself runs on 4 logical CPUs.

Logical devices can only be configured before TensorFlow initialises, so it happens
here, once, before any test imports a model. Tests that need another layout run in
worker processes (tf_distrib.testing.run_workers).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tf_distrib  # noqa: E402

LOGICAL_CPUS = 4
tf_distrib.use_logical_cpus(LOGICAL_CPUS)
tf.get_logger().setLevel("ERROR")
