"""Runs examples/train.py's `train` on Ray Train, restarting the workers after a failure.

    pip install "tf_distrib[ray]"
    python examples/ray_train.py --num-workers 2 --max-failures 1

On a Ray cluster, start it with RAY_ADDRESS set (or `ray job submit`) and give a
--storage-path that every node shares (gs://bucket/runs, /mnt/shared/runs).
"""

import argparse
import os

import ray

from tf_distrib.integrations import ray as td_ray

HERE = os.path.dirname(os.path.abspath(__file__))


def train_loop(config):
    from train import train  # examples/ is Ray's working_dir on every worker

    # The backup and the model live in the run's folder on its storage, which a
    # restarted worker group finds again.
    train(td_ray.backup_dir(), td_ray.run_dir(), config["epochs"],
          num_examples=config["examples"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument("--storage-path", default=None, help="defaults to ~/ray_results")
    parser.add_argument("--name", default="tf_distrib_example")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--examples", type=int, default=16384)
    args = parser.parse_args(argv)
    ray.init(runtime_env={"working_dir": HERE})
    trainer = td_ray.make_trainer(
        train_loop, num_workers=args.num_workers, max_failures=args.max_failures,
        storage_path=args.storage_path, name=args.name,
        config={"epochs": args.epochs, "examples": args.examples})
    result = trainer.fit()
    print(f"run finished: {result.path}")


if __name__ == "__main__":
    main()
