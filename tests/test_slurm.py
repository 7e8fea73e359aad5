"""examples/train.sbatch under a real Slurm: trains, survives preemption, kills, requeues.

One node ("localhost", 2 CPUs) runs both tasks, 2 workers through `srun`; and two nodes
on simulated hosts (`tf_distrib.testing.simulated_hosts`, one task each, the workers' hostnames
and addresses from Slurm's node list, the TCP ring between them).
"""

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import _slurm
from tf_distrib.testing import simulated_hosts

pytestmark = [pytest.mark.multiprocess, pytest.mark.slurm]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS = 4  # 64 steps an epoch; a backup every 50 steps
HANG_TIMEOUT = 20
DIGEST = re.compile(r"final weights sha256 ([0-9a-f]{64})")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _slurm.missing()
    if why:
        pytest.skip(f"needs {why}")
    cluster = _slurm.Slurm(str(tmp_path_factory.mktemp("slurm")))
    yield cluster
    cluster.stop()
    left = subprocess.run(["pgrep", "-a", "-f", cluster.dir], capture_output=True, text=True)
    assert not left.stdout, f"Slurm processes left: {left.stdout}"
    assert not subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True).stdout


@pytest.fixture(scope="module")
def slurm_on_two_hosts(tmp_path_factory):
    why = _slurm.missing() or simulated_hosts.unavailable()
    if why:
        pytest.skip(f"needs {why}")
    with simulated_hosts.SimulatedHosts(2, rate=None) as hosts:
        cluster = _slurm.Slurm(str(tmp_path_factory.mktemp("slurm2")), hosts)
        yield cluster
        cluster.stop()
    left = subprocess.run(["pgrep", "-a", "-f", cluster.dir], capture_output=True, text=True)
    assert not left.stdout, f"Slurm processes left: {left.stdout}"
    assert not subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True).stdout


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The digest of the same script under `tf-distrib launch -n 2`."""
    run = tmp_path_factory.mktemp("launched")
    done = subprocess.run(
        [sys.executable, "-m", "tf_distrib.launch", "-n", "2", "--timeout", "300",
         "examples/train.py", "--backup-dir", str(run / "backup"), "--model-dir",
         str(run / "model"), "--epochs", str(EPOCHS)],
        cwd=REPO, capture_output=True, text=True, timeout=330)
    assert done.returncode == 0, done.stderr[-3000:]
    [digest] = set(DIGEST.findall(done.stdout))
    return digest


def _submit(slurm, shared, *sbatch_options, nodes=1):
    env = {"SHARED": str(shared), "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ["PATH"],
           "TF_DISTRIB_SLURM_PORT_BASE": str(_slurm.slurm_port_base(2 // nodes)),
           "TF_DISTRIB_HANG_TIMEOUT": str(HANG_TIMEOUT), "TF_CPP_MIN_LOG_LEVEL": "2",
           "TMPDIR": os.environ["TMPDIR"]}  # the test session's (tests/conftest.py)
    # The documented edits for small nodes: sbatch's own options override the script's.
    return slurm.sbatch([f"--nodes={nodes}", f"--ntasks-per-node={2 // nodes}",
                         "--cpus-per-task=1",
                         "--open-mode=append", f"--output={shared}/job-%j.out",
                         *sbatch_options, "examples/train.sbatch", "--epochs", str(EPOCHS)],
                        cwd=REPO, env=env)


def _output(shared, job_id) -> str:
    with open(f"{shared}/job-{job_id}.out") as f:
        return f.read()


def _wait_for_backup(slurm, shared, job_id):
    deadline = time.monotonic() + 240
    while not glob.glob(f"{shared}/backup/backup-*/manifest.json"):
        assert slurm.job(job_id)["JobState"] in ("PENDING", "RUNNING"), _output(shared, job_id)
        assert time.monotonic() < deadline, _output(shared, job_id)
        time.sleep(0.2)


def _task_pid(slurm, job_id, rank, node=0) -> int:
    """The pid of the running step's task `rank` (global), which runs on `node`."""
    deadline = time.monotonic() + 60
    while True:
        listed = slurm.run(["scontrol", "listpids", str(job_id)], node=node).stdout
        for line in listed.splitlines()[1:]:
            pid, _, step, _, task = line.split()
            if step != "batch" and task == str(rank):
                return int(pid)
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)


def _assert_finished_equal(slurm, shared, job_id, launched) -> str:
    job = slurm.wait(job_id, 400)
    out = _output(shared, job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert DIGEST.findall(out)[-2:] == [launched, launched], out
    return out


def test_sbatch_trains_on_two_tasks_like_tf_distrib_launch(slurm, tmp_path, launched):
    job_id = _submit(slurm, tmp_path)
    out = _assert_finished_equal(slurm, tmp_path, job_id, launched)
    assert "restarting from the last backup" not in out


def test_a_preempted_job_saves_at_one_step_and_resumes_bitwise(slurm, tmp_path, launched):
    job_id = _submit(slurm, tmp_path)
    _wait_for_backup(slurm, tmp_path, job_id)
    slurm.run(["scancel", "--signal=TERM", str(job_id)])
    out = _assert_finished_equal(slurm, tmp_path, job_id, launched)
    # The workers save together, at one step. srun reports the first task's status 42,
    # and --kill-on-bad-exit then ends the step: a task that has saved but not yet exited
    # may be reported "Terminated" (seen in CI), so its own line is what counts.
    saved = re.findall(r"preempted \(SIGTERM\); saved at step (\d+), exiting with status 42",
                       out)
    assert saved and len(set(saved)) == 1, out
    assert re.search(r"tasks? [\d,-]+: Exited with exit code 42", out), out
    assert "attempt 1 failed; restarting from the last backup" in out


def test_a_requeued_job_resumes_from_its_backup_bitwise(slurm, tmp_path, launched):
    job_id = _submit(slurm, tmp_path)
    _wait_for_backup(slurm, tmp_path, job_id)
    done = slurm.run(["scontrol", "requeue", str(job_id)])
    assert done.returncode == 0, done.stderr
    requeued = slurm.wait(job_id, 120, until=lambda job: job.get("Restarts") == "1"
                          and job.get("JobState") == "PENDING")
    # Slurm holds a requeued job about two minutes before it may start again.
    assert requeued["Reason"] == "BeginTime"
    done = slurm.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
    assert done.returncode == 0, done.stderr
    _assert_finished_equal(slurm, tmp_path, job_id, launched)


def test_a_task_killed_by_the_node_restarts_from_the_last_backup(slurm, tmp_path, launched):
    job_id = _submit(slurm, tmp_path)
    _wait_for_backup(slurm, tmp_path, job_id)
    os.kill(_task_pid(slurm, job_id, 1), signal.SIGKILL)
    out = _assert_finished_equal(slurm, tmp_path, job_id, launched)
    assert "attempt 1 failed; restarting from the last backup" in out


def test_a_stuck_task_is_named_within_the_hang_timeout(slurm, tmp_path, launched):
    job_id = _submit(slurm, tmp_path)
    _wait_for_backup(slurm, tmp_path, job_id)
    os.kill(_task_pid(slurm, job_id, 1), signal.SIGSTOP)
    stopped = time.monotonic()
    deadline = stopped + HANG_TIMEOUT + 30
    while "restarting from the last backup" not in _output(tmp_path, job_id):
        assert time.monotonic() < deadline, _output(tmp_path, job_id)
        time.sleep(0.2)
    out = _assert_finished_equal(slurm, tmp_path, job_id, launched)
    # Worker 0's watchdog names it, or, when worker 0 waits in one of TensorFlow's own
    # collectives (reading the metrics for a backup), TensorFlow's coordination service
    # does first (its heartbeat times out after ~10 s).
    assert re.search(r"tf_distrib watchdog: worker:0: no step finished for 20 s \(last "
                     r"finished step: step \d+ at [\d:]+; waiting for worker:1 \(", out) or (
        "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1" in out), out


def test_two_nodes_train_across_hosts_and_restart_a_killed_task(slurm_on_two_hosts, tmp_path,
                                                                launched):
    slurm = slurm_on_two_hosts
    job_id = _submit(slurm, tmp_path, nodes=2)
    _wait_for_backup(slurm, tmp_path, job_id)
    os.kill(_task_pid(slurm, job_id, 1, node=1), signal.SIGKILL)
    out = _assert_finished_equal(slurm, tmp_path, job_id, launched)
    assert "attempt 1 failed; restarting from the last backup" in out
    # Each task ran on its own host, and the workers summed over the network between them.
    assert re.search(r"host1: task 1: Killed", out), out
