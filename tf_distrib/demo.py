"""The demo job: 2 local workers train a small classifier with MultiWorkerMirroredStrategy.

Worker 1 is killed midway through the first attempt; the launcher restarts both and
`callbacks.BackupAndRestore` resumes training from the newest of its last backup and
its in-memory snapshot.

`make demo` / `tf-distrib demo` runs `main()`. `train()` is the per-worker job; the
tests reuse it to check that multi-worker and single-process runs agree.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

from tf_distrib.datasets import NUM_EXAMPLES, build_model, make_data


def train(epochs: int = 3, global_batch_size: int = 64, seed: int = 1,
          logical_cpus: int | None = None, return_weights: bool = False,
          verbose: int = 0, kill_at_step: int | None = None,
          backup_dir: str | None = None, data_dir: str | None = None) -> dict:
    """Trains the demo model with `make_strategy()` and returns a summary.

    Args:
        epochs: Epochs to train. Defaults to 3.
        global_batch_size: Examples per step across all replicas. Defaults to 64.
        seed: Seed of weights and shuffling. Defaults to 1.
        logical_cpus: Split the CPU into this many replicas first. Defaults to None.
        return_weights: Include the final weights in the summary. Defaults to False.
        verbose: Keras verbosity. Defaults to 0.
        kill_at_step: Fault injection: on the launcher's first attempt, worker 1
            SIGKILLs itself after this many training steps. Defaults to None.
        backup_dir: Back up every 20 steps there with `callbacks.BackupAndRestore`,
            and resume from it (or from its newer in-memory snapshot). Defaults to
            None (no backups).
        data_dir: Read the shipped TFDS dataset `tf_distrib_blobs` prepared there
            (`tf_distrib.datasets.prepare`). Defaults to None: the same data from memory.

    Returns:
        A dict with task, replicas, per-epoch losses, final accuracy, examples/sec
        and (optionally) weights.
    """
    import warnings

    import keras
    import tensorflow as tf

    import tf_distrib as td

    # distribute_dataset shuffles; Keras warns that its own `shuffle` does not apply.
    warnings.filterwarnings("ignore", message="`shuffle=True` was passed")
    if logical_cpus:
        td.use_logical_cpus(logical_cpus)
    keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()
    strategy = td.make_strategy()
    spec = td.cluster.from_environment()
    if data_dir:
        source = td.data.tfds_source("tf_distrib_blobs", "train", data_dir=data_dir)
    else:
        source = tf.data.Dataset.from_tensor_slices(make_data())
    with strategy.scope():
        model = build_model()
    dataset = td.data.distribute_dataset(strategy, source, global_batch_size,
                                         shuffle_buffer=NUM_EXAMPLES, seed=seed)
    steps = dataset.steps_per_epoch
    start = time.perf_counter()
    callbacks = []
    if backup_dir:
        callbacks.append(td.callbacks.BackupAndRestore(backup_dir, save_freq=20))
    if kill_at_step is not None:
        callbacks.append(_KillWorker1OnFirstAttempt(kill_at_step))
    history = model.fit(dataset, epochs=epochs, verbose=verbose, callbacks=callbacks)
    seconds = time.perf_counter() - start
    summary = {
        "task": "local" if spec is None else spec.task,
        "workers": 1 if spec is None else spec.num_workers,
        "replicas": strategy.num_replicas_in_sync,
        "loss": [float(v) for v in history.history["loss"]],
        "accuracy": float(history.history["accuracy"][-1]),
        "examples_per_sec": len(history.epoch) * steps * global_batch_size / seconds,
        "resumed_from_step": callbacks[0].restored_step if backup_dir else None,
    }
    if return_weights:
        summary["weights"] = [w.numpy() for w in model.weights]
    return summary


def _KillWorker1OnFirstAttempt(step: int):
    import keras

    from tf_distrib.contract import ENV_ATTEMPT, ENV_WORKER_INDEX

    class KillWorker1OnFirstAttempt(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if (self.steps == step and os.environ.get(ENV_ATTEMPT) == "0"
                    and os.environ.get(ENV_WORKER_INDEX) == "1"):
                print(f"injected failure: SIGKILL at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    return KillWorker1OnFirstAttempt()


def _prepare_quietly(data_dir: str) -> None:
    """Builds the TFDS dataset once, before the workers start, without progress bars.

    TensorFlow's start-up notices go to file descriptor 2 from C++, past Python's
    sys.stderr: they are kept aside and shown only if the preparation fails.
    """
    import contextlib
    import io

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    saved = os.dup(2)
    with tempfile.TemporaryFile() as notices:
        os.dup2(notices.fileno(), 2)
        try:
            import tensorflow_datasets as tfds

            import tf_distrib.datasets

            tfds.disable_progress_bar()
            with contextlib.redirect_stdout(io.StringIO()):
                tf_distrib.datasets.prepare(data_dir)
        except BaseException:
            os.dup2(saved, 2)
            notices.seek(0)
            sys.stderr.write(notices.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    print(f"dataset: tf_distrib_blobs (TFDS, generated locally) in {data_dir}", flush=True)


def format_summary(results: list[dict]) -> str:
    """One table row per worker summary returned by `train`."""
    rows = [f"{'task':<10}{'workers':>8}{'replicas':>9}{'final loss':>12}{'accuracy':>10}"
            f"{'examples/s':>12}"]
    for r in results:
        rows.append(f"{r['task']:<10}{r['workers']:>8}{r['replicas']:>9}{r['loss'][-1]:>12.4f}"
                    f"{r['accuracy']:>10.3f}{r['examples_per_sec']:>12.0f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """`tf-distrib demo`: launch the demo with an injected failure and print the summary."""
    parser = argparse.ArgumentParser(prog="tf-distrib demo", description=__doc__)
    parser.add_argument("-n", "--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-at-step", type=int, default=100,
                        help="SIGKILL worker 1 after this many steps on the first attempt "
                             "(0: no injected failure)")
    options = parser.parse_args(argv)

    from tf_distrib.launch import launch

    print(f"tf_distrib demo: {options.num_workers} workers on 127.0.0.1, "
          "MultiWorkerMirroredStrategy, Keras model.fit, --max-restarts 1; worker 1 is "
          f"killed at step {options.kill_at_step} of the first attempt", flush=True)
    with tempfile.TemporaryDirectory(prefix="tf_distrib_demo_") as tmp:
        data_dir, backup_dir = os.path.join(tmp, "tfds"), os.path.join(tmp, "backup")
        _prepare_quietly(data_dir)
        result = launch(train, options.num_workers, max_restarts=1, timeout=600,
                        kwargs={"epochs": options.epochs, "backup_dir": backup_dir,
                                "data_dir": data_dir,
                                "kill_at_step": options.kill_at_step or None},
                        # Readable output: oneDNN's notice is TensorFlow's noisiest line.
                        env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    print("\nAttempts")
    for attempt in result.attempts:
        outcome = attempt.failure or "all workers finished"
        step = attempt.workers[0].value and attempt.workers[0].value["resumed_from_step"]
        if step is not None:
            outcome += f", resumed from the backup at step {step}"
        print(f"  attempt {attempt.number}: {outcome}")
    if result.exit_code != 0:
        print(f"demo failed: {result.failure_report()}", file=sys.stderr)
        return result.exit_code
    print(f"\nSummary ({result.restarts} restart(s))\n" + format_summary(result.values),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
