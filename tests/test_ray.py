"""Ray Train: a tf_distrib script on `TensorflowTrainer`, a local Ray cluster, 2 CPU workers."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from tests._ray_training import train_on_ray

ray = pytest.importorskip("ray", reason="needs the ray extra (pip install 'tf_distrib[ray]'); "
                                        "`make test` installs it")
from tf_distrib.integrations import ray as td_ray  # noqa: E402

pytestmark = pytest.mark.multiprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS, SAVE_FREQ, STEPS_PER_EPOCH = 2, 5, 16  # 512 examples, global batch 32


@pytest.fixture(scope="module")
def local_ray():
    """A local 2-CPU Ray cluster for the module; yields its address."""
    # Workers import the training job from tests/.
    context = ray.init(num_cpus=2, include_dashboard=False,
                       runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT}})
    yield context.address_info["address"]
    ray.shutdown()


def fit(trainer, timeout=240.0):
    """trainer.fit(), stopped by shutting Ray down if it runs past `timeout`."""
    outcome = {}

    def run():
        try:
            outcome["result"] = trainer.fit()
        except Exception as e:  # noqa: BLE001 - reported in the main thread
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        ray.shutdown()
        pytest.fail(f"the Ray run did not finish within {timeout:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def run_training(tmp_path, name, num_workers=2, **config):
    scratch = tmp_path / name
    scratch.mkdir()
    trainer = td_ray.make_trainer(
        train_on_ray, num_workers=num_workers, max_failures=1,
        storage_path=str(tmp_path / "storage"),
        name=name, config={"scratch": str(scratch), "epochs": EPOCHS, "save_freq": SAVE_FREQ,
                           "kill_worker": 1, **config})
    fit(trainer)
    results = [json.loads((scratch / f"result_{r}.json").read_text()) for r in (0, 1)]
    weights = []
    for rank in (0, 1):
        with np.load(scratch / f"weights_{rank}.npz") as f:
            weights.append([f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))])
    return results, weights, scratch


@pytest.fixture(scope="module")
def uninterrupted(local_ray, tmp_path_factory):
    return run_training(tmp_path_factory.mktemp("ray"), "uninterrupted")


def test_two_ray_workers_train_in_sync(uninterrupted):
    results, weights, _ = uninterrupted
    # Ray gives a worker-only cluster; tf_distrib undid Ray's Keras 2 switch.
    assert [r["tf_config"]["task"] for r in results] == [
        {"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    assert [r["legacy_keras"] for r in results] == [None, None]
    assert [r["iterations"] for r in results] == [EPOCHS * STEPS_PER_EPOCH] * 2
    assert results[0]["run_dir"].endswith("storage/uninterrupted")
    for w0, w1 in zip(*weights, strict=True):
        np.testing.assert_array_equal(w0, w1)


def test_killed_ray_worker_resumes_from_backup_exactly(uninterrupted, tmp_path):
    _, reference, _ = uninterrupted
    kill_at = STEPS_PER_EPOCH + 7  # mid-epoch 2, two steps after the backup at step 20
    results, weights, scratch = run_training(tmp_path, "killed", kill_at=kill_at)
    assert (scratch / "killed").exists()
    # Ray restarted the group (max_failures=1) and both workers resumed from step 20.
    assert [r["restored_step"] for r in results] == [20, 20]
    assert [r["iterations"] for r in results] == [EPOCHS * STEPS_PER_EPOCH] * 2
    for got, want in zip(weights[0], reference[0], strict=True):
        np.testing.assert_array_equal(got, want)
    for w0, w1 in zip(*weights, strict=True):
        np.testing.assert_array_equal(w0, w1)


def test_elastic_worker_count_takes_what_the_cluster_has(local_ray, tmp_path, uninterrupted):
    # (1, 4) workers on a 2-CPU cluster: Ray Train starts the 2 that fit.
    results, weights, _ = run_training(tmp_path, "elastic", num_workers=(1, 4))
    assert [r["tf_config"]["task"]["index"] for r in results] == [0, 1]
    for got, want in zip(weights[0], uninterrupted[1][0], strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_ray_example_runs_the_same_script(local_ray, tmp_path, uninterrupted):
    # Its own driver, on this module's cluster (starting a second one costs ~20 s).
    done = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "ray_train.py"),
         "--max-failures", "0", "--storage-path", str(tmp_path), "--name", "example",
         "--epochs", "2", "--examples", "2048"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "RAY_ADDRESS": local_ray})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "example" / "model.keras").exists()
    # Epoch 1's backup made the directory (none follows the last step: fit deletes them).
    assert (tmp_path / "example" / "tf_distrib_backup").is_dir()


def test_make_trainer_rejects_bad_arguments():
    with pytest.raises(TypeError, match="train_fn must be callable"):
        td_ray.make_trainer("train.py")
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        td_ray.make_trainer(train_on_ray, num_workers=0)
    with pytest.raises(ValueError, match="num_workers' max must be an integer >= 3"):
        td_ray.make_trainer(train_on_ray, num_workers=(3, 2))
    with pytest.raises(ValueError, match="num_workers must be an int or \\(min, max\\)"):
        td_ray.make_trainer(train_on_ray, num_workers=(1, 2, 3))
    with pytest.raises(ValueError, match="max_failures must be an integer >= -1"):
        td_ray.make_trainer(train_on_ray, max_failures=-2)
    with pytest.raises(ValueError, match="cpus_per_worker must be a number > 0"):
        td_ray.make_trainer(train_on_ray, cpus_per_worker=0)
    with pytest.raises(ValueError, match="cpus_per_worker must be a number > 0, got '2'"):
        td_ray.make_trainer(train_on_ray, cpus_per_worker="2")


def test_run_storage_maps_to_tensorflow_paths():
    assert td_ray._gfile_path("local", "/runs/a") == "/runs/a"
    assert td_ray._gfile_path("gcs", "bucket/runs/a") == "gs://bucket/runs/a"
    assert td_ray._gfile_path("s3", "bucket/runs/a") == "s3://bucket/runs/a"
    with pytest.raises(ValueError, match="'py::fsspec\\+memory' filesystem.*gs://"):
        td_ray._gfile_path("py::fsspec+memory", "runs/a")
    with pytest.raises(ValueError, match="non-empty folder name"):
        td_ray.backup_dir("a/b")
