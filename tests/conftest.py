"""Shared set-up: the pytest process itself runs on 4 logical CPUs, and every process
the tests start gets a private TMPDIR; at the end, whatever they left is removed and
fails the session (tests/_leftovers.py).

Launches fork their workers from a preloaded server (TF_DISTRIB_PRELOAD=1,
`tf_distrib.launch.forkserver`): starting TensorFlow in fresh worker processes was the
suite's largest cost (28:54 -> 21:31 on a 2-core VM; docs/performance.md).
TF_DISTRIB_PRELOAD=0 starts them fresh; tests/test_launch.py checks both starts.

Logical devices can only be configured before TensorFlow initialises, so it happens
here, once, before any test imports a model. Tests that need another layout run in
worker processes (tf_distrib.testing.run_workers).
"""

import os
import tempfile
import time

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pytest's own tmp_path stays where it was: pytest keeps the last runs' for a look.
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
SESSION_TMPDIR = tempfile.mkdtemp(prefix="tf_distrib-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = SESSION_TMPDIR  # this process's launches too
os.environ.setdefault("TF_DISTRIB_PRELOAD", "1")
_STARTED = time.time()
_left: list[str] = []

import tensorflow as tf  # noqa: E402

import tf_distrib  # noqa: E402
from tests import _leftovers  # noqa: E402
from tf_distrib.launch import forkserver  # noqa: E402

LOGICAL_CPUS = 4
tf_distrib.use_logical_cpus(LOGICAL_CPUS)
tf.get_logger().setLevel("ERROR")


def pytest_sessionfinish(session):
    forkserver.close_all()
    _left.extend(_leftovers.collect(SESSION_TMPDIR, _STARTED))
    if _left and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _left:
        terminalreporter.section("left behind by the tests: now removed; the run fails", red=True)
        for line in _left:
            terminalreporter.line(line)
