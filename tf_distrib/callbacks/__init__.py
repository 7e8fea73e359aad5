"""Keras callbacks for distributed training."""

from tf_distrib.callbacks.backup_and_restore import BackupAndRestore
from tf_distrib.launch.launcher import PREEMPTED_EXIT_CODE

__all__ = ["BackupAndRestore", "PREEMPTED_EXIT_CODE"]
