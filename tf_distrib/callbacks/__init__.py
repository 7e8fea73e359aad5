"""Keras callbacks for distributed training."""

from tf_distrib.callbacks.backup_and_restore import BackupAndRestore, BackupError
from tf_distrib.callbacks.chief_only import ChiefOnly, chief_verbose, is_chief
from tf_distrib.callbacks.throughput import Throughput
from tf_distrib.callbacks.timeline import Timeline
from tf_distrib.callbacks.worker_metrics import WorkerMetrics
from tf_distrib.contract import PREEMPTED_EXIT_CODE

__all__ = ["BackupAndRestore", "BackupError", "ChiefOnly", "Throughput", "Timeline",
           "WorkerMetrics", "chief_verbose", "is_chief", "PREEMPTED_EXIT_CODE"]
