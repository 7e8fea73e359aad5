"""Start N workers with TF_CONFIG, stream their output, restart the group on failure.

The library side (`launch()`) is separate from the command line (`cli.py`) so that
notebooks and tests reuse exactly what `tf-distrib launch` runs.
"""

from tf_distrib.contract import (
    ENV_ATTEMPT,
    ENV_MAX_RESTARTS,
    ENV_NUM_WORKERS,
    ENV_STARTUP_TIMEOUT,
    ENV_WORKER_INDEX,
    PREEMPTED_EXIT_CODE,
)
from tf_distrib.launch.config import LaunchConfig
from tf_distrib.launch.errors import LaunchError
from tf_distrib.launch.launcher import Attempt, LaunchResult, WorkerResult, launch

__all__ = ["launch", "LaunchConfig", "LaunchResult", "Attempt", "WorkerResult", "LaunchError",
           "ENV_WORKER_INDEX", "ENV_NUM_WORKERS", "ENV_ATTEMPT", "ENV_MAX_RESTARTS",
           "ENV_STARTUP_TIMEOUT", "PREEMPTED_EXIT_CODE"]
