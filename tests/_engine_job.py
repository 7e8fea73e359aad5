"""One worker of the simulated-engine runs: `python -m tests._engine_job OUT BACKUP_DIR`.

Reads its cluster only from the engine's environment, trains with BackupAndRestore and
writes what it saw and its final weights to OUT (JSON). ENGINE_JOB_EPOCHS sets the
epochs (default 1); ENGINE_JOB_KILL_AT makes worker 1 SIGKILL itself after that many
steps on attempt 0 (TF_DISTRIB_ATTEMPT, TF_DISTRIB_WORKER_INDEX).
"""

import hashlib
import json
import os
import sys

from tests._training import train_with_backup
from tf_distrib.cluster import from_environment


def main(out, backup_dir):
    spec = from_environment()
    kill_at = int(os.environ.get("ENGINE_JOB_KILL_AT", 0)) or None
    result = train_with_backup(backup_dir, epochs=int(os.environ.get("ENGINE_JOB_EPOCHS", 1)),
                               num_examples=256, kill_at=kill_at, kill_worker=1)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in result["weights"])).hexdigest()
    with open(out, "w") as f:
        json.dump({"task": [spec.task_type, spec.task_index], "is_chief": spec.is_chief,
                   "num_workers": spec.num_workers, "strategy": result["strategy"],
                   "replicas": result["replicas"], "iterations": result["iterations"],
                   "restored_step": result["restored_step"],
                   "weights_sha256": digest}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
