"""The example training script: this one file runs unchanged on every engine.

    python examples/train.py                        # one process, local devices
    tf-distrib launch -n 2 examples/train.py        # 2 workers on this machine
    srun python examples/train.py ...               # Slurm: examples/train.sbatch
    kubectl create -f examples/tfjob.yaml           # Kubeflow TFJob
    gcloud ai custom-jobs create --config=examples/vertex_job.yaml ...   # Vertex AI
    python examples/ray_train.py                    # Ray Train

`make_strategy()` reads the cluster each engine describes (TF_CONFIG, Vertex AI's
CLUSTER_SPEC, Slurm's srun variables) and `BackupAndRestore` resumes a restarted job
from `--backup-dir`, which must be storage every worker shares (a shared filesystem,
gs://). See docs/scale_out.md.
"""

import argparse
import os


def train(backup_dir: str, model_dir: str, epochs: int = 3, global_batch_size: int = 256,
          num_examples: int = 16384, seed: int = 1) -> str:
    """Trains the demo classifier on every worker; the chief saves the final model.

    Args:
        backup_dir: Shared directory for `BackupAndRestore`.
        model_dir: Where the chief writes `model.keras`.
        epochs: Defaults to 3.
        global_batch_size: Examples per step over all workers. Defaults to 256.
        num_examples: Size of the generated dataset. Defaults to 16384.
        seed: Seeds weights, shuffling and dropout: runs with one seed end bitwise
            equal, however often they were interrupted. Defaults to 1.

    Returns:
        The SHA-256 of the final weights, which every worker prints: equal on every
        worker, and equal between runs of the same seed.
    """
    import hashlib

    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.datasets import build_model, make_data

    keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()
    strategy = td.make_strategy()
    with strategy.scope():
        model = build_model()
    dataset = td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices(make_data(num_examples)),
        global_batch_size, shuffle_buffer=num_examples)
    model.fit(dataset, epochs=epochs, verbose=td.callbacks.chief_verbose(2, strategy),
              callbacks=[td.callbacks.BackupAndRestore(backup_dir, save_freq=50)],
              shuffle=False)  # distribute_dataset shuffles already
    if td.callbacks.is_chief(strategy):
        tf.io.gfile.makedirs(model_dir)
        model.save(f"{model_dir.rstrip('/')}/model.keras")
    digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in model.weights)).hexdigest()
    print(f"final weights sha256 {digest}", flush=True)
    return digest


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Vertex AI names the job's Cloud Storage folders in AIP_* variables.
    parser.add_argument("--backup-dir", default=os.environ.get("AIP_CHECKPOINT_DIR",
                                                               "run/backup"))
    parser.add_argument("--model-dir", default=os.environ.get("AIP_MODEL_DIR", "run/model"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--examples", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    train(args.backup_dir, args.model_dir, args.epochs, num_examples=args.examples,
          seed=args.seed)


if __name__ == "__main__":
    main()
