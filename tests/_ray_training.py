"""The training job that the Ray tests run in Ray Train workers."""

import json
import os


def train_on_ray(config):
    """Trains `_training.train_with_backup` with its backup on the Ray run's storage.

    Worker `kill_worker` SIGKILLs itself after `kill_at` steps, once per scratch
    directory. Each worker writes its final weights and counters to the scratch dir.
    """
    import numpy as np

    from tests._training import train_with_backup
    from tf_distrib.integrations import ray as td_ray

    scratch = config["scratch"]
    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    killed_marker = os.path.join(scratch, "killed")
    kill_now = config.get("kill_at") and rank == config["kill_worker"] and not os.path.exists(
        killed_marker)
    if kill_now:
        open(killed_marker, "w").close()
    os.environ["TF_DISTRIB_ATTEMPT"] = "0" if kill_now else "1"
    result = train_with_backup(td_ray.backup_dir(), epochs=config["epochs"],
                               save_freq=config["save_freq"], kill_at=config.get("kill_at"),
                               kill_worker=config["kill_worker"], num_examples=512)
    np.savez(os.path.join(scratch, f"weights_{rank}.npz"), *result["weights"])
    with open(os.path.join(scratch, f"result_{rank}.json"), "w") as f:
        json.dump({"iterations": result["iterations"], "restored_step": result["restored_step"],
                   "tf_config": json.loads(os.environ["TF_CONFIG"]),
                   "legacy_keras": os.environ.get("TF_USE_LEGACY_KERAS"),
                   "run_dir": td_ray.run_dir()}, f)
