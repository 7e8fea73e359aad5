"""Multi-host paths across simulated hosts: own address, hostname and /dev/shm each.

Every host runs its own `tf-distrib launch --hosts ... --host-index i`; the hosts talk
over veth links through a bridge, shaped to 10 Gbit/s (tf_distrib.testing.simulated_hosts).
"""

import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tf_distrib.testing import simulated_hosts
from tf_distrib.testing.simulated_hosts import SimulatedHosts

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(simulated_hosts.unavailable() is not None,
                                 reason=f"needs {simulated_hosts.unavailable()}")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "tests", "_multi_host.py")
ENV = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
PORT = 29400  # every host has its own network stack: no port is taken
LONG = ["--epochs", "20"]  # ~10 s of training: a partition lands in the middle of it


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    assert simulated_hosts.namespaces() == []


class _Launcher:
    """One host's `tf-distrib launch`, its console output collected as it comes."""

    def __init__(self, process):
        self.process, self.lines = process, []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout) -> str:
        self.process.wait(timeout)
        self._reader.join(10)
        return self.output


def _launch(hosts, out, workers_per_host=1, launcher_args=(), job_args=(), timeout=300,
            only=None, log_dir=None):
    """Starts one launcher per host (on host `only` alone, if given)."""
    spec = ",".join(f"{address}:{PORT}" for address in hosts.addresses)
    return [_Launcher(hosts.run(
        i, [sys.executable, "-m", "tf_distrib.launch", "-n", str(workers_per_host),
            "--hosts", spec, "--host-index", str(i), "--timeout", str(timeout),
            "--log-dir", str(out / (log_dir or f"logs-{i}")), *launcher_args, JOB, str(out),
            *job_args],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for i in range(len(hosts.addresses)) if only in (None, i)]


def _finish(launchers, timeout=400):
    outputs = [launcher.finish(timeout) for launcher in launchers]
    assert [p.process.returncode for p in launchers] == [0] * len(launchers), "\n".join(outputs)
    return outputs


def _weights(out, index):
    with np.load(out / f"weights-{index}.npz") as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same job in one process on the global batch: the reference within fp32 order."""
    out = tmp_path_factory.mktemp("one_process")
    env = {k: v for k, v in ENV.items() if not k.startswith(("TF_CONFIG", "TF_DISTRIB_"))}
    done = subprocess.run([sys.executable, JOB, str(out), "--epochs", "3"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _weights(out, "single")


@pytest.fixture(scope="module")
def two_hosts_uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    with SimulatedHosts(2) as hosts:
        _finish(_launch(hosts, out, job_args=[*LONG, "--backup-dir", str(out / "backup")]))
    return _weights(out, 0)


@pytest.mark.parametrize("num_hosts, per_host, transport", [(2, 1, "tcp"), (3, 1, "tcp"),
                                                              (2, 2, "shm+tcp")],
                         ids=["2 hosts", "3 hosts", "2 hosts x 2 workers"])
def test_hosts_train_like_one_process_and_agree_bitwise(tmp_path, one_process, num_hosts,
                                                        per_host, transport):
    with SimulatedHosts(num_hosts) as hosts:
        # A bucket per layer or less (W2 + b2, b1, W1): each bucket's start reorders the
        # backward pass (`backward_order`), which must not change a value.
        outputs = _finish(_launch(hosts, tmp_path, per_host,
                                  job_args=["--epochs", "3", "--bucket-bytes", "600"]))
    assert all(f"trained with transport {transport}\n" in output for output in outputs), outputs
    workers = [_weights(tmp_path, i) for i in range(num_hosts * per_host)]
    for other in workers[1:]:
        for a, b in zip(workers[0], other, strict=True):
            np.testing.assert_array_equal(a, b)
    for got, want in zip(workers[0], one_process, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_hostnames_and_shared_memory_are_the_hosts_own(tmp_path):
    probe = ("import os, socket; print(socket.gethostname(), os.stat('/dev/shm').st_dev, "
             "os.getcwd(), *map(socket.gethostbyname, ['host0', 'host1']), "
             "open('/dev/shm/probe', 'w').close() or os.listdir('/dev/shm'))")
    with SimulatedHosts(2) as hosts:
        seen = [hosts.run(i, [sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True,
                          cwd=tmp_path).communicate(timeout=30)[0].split(maxsplit=5)
                for i in range(2)]
    assert [s[0] for s in seen] == ["host0", "host1"]
    assert seen[0][1] != seen[1][1] != str(os.stat("/dev/shm").st_dev)
    # Each host runs in the directory given and resolves every host's name, as on a cluster.
    assert [s[2:5] for s in seen] == [[str(tmp_path), "198.18.0.1", "198.18.0.2"]] * 2
    assert not os.path.exists("/dev/shm/probe")


def test_a_short_partition_passes_unnoticed(tmp_path, two_hosts_uninterrupted):
    with SimulatedHosts(2) as hosts:
        launchers = _launch(hosts, tmp_path, job_args=[*LONG, "--backup-dir",
                                                       str(tmp_path / "backup")])
        _wait_for_backup(tmp_path / "backup", launchers)
        hosts.partition(1)
        time.sleep(3)
        hosts.heal(1)
        assert all(launcher.process.poll() is None for launcher in launchers)  # mid-training
        outputs = _finish(launchers)
    assert not any("failed" in output for output in outputs), outputs
    for got, want in zip(_weights(tmp_path, 0), two_hosts_uninterrupted, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_long_partition_names_the_lost_host_and_the_job_resumes_bitwise(
        tmp_path, two_hosts_uninterrupted):
    with SimulatedHosts(2) as hosts:
        # No communication_timeout: TensorFlow's collectives would then time out unnamed.
        # Its coordination service's heartbeat (~10 s) and the transport (30 s) name peers.
        launchers = _launch(hosts, tmp_path, launcher_args=["--max-restarts", "1"],
                            job_args=[*LONG, "--backup-dir", str(tmp_path / "backup")])
        _wait_for_backup(tmp_path / "backup", launchers)
        cut = time.monotonic()
        hosts.partition(1)
        _wait_for(lambda: all("restarting (1/1)" in launcher.output for launcher in launchers),
                  deadline=cut + 30 + 30, launchers=launchers)
        hosts.heal(1)
        outputs = _finish(launchers)
    # The survivor names the lost host: the transport by address, or TensorFlow's
    # coordination service (its heartbeat also times out after ~10 s) by task. (The cut-off
    # side may only see its heartbeat to the service time out.)
    log = _log(tmp_path, 0, attempt=0)
    assert "worker:1 (198.18.0.2:" in log or "/job:worker/replica:0/task:1" in log, log[-3000:]
    assert all("after 1 restart(s)" in output for output in outputs), outputs
    for got, want in zip(_weights(tmp_path, 0), two_hosts_uninterrupted, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_lost_host_leaves_the_job_to_the_other_which_resumes_from_the_backup(
        tmp_path, two_hosts_uninterrupted):
    with SimulatedHosts(2) as hosts:
        launchers = _launch(hosts, tmp_path, launcher_args=[
            "--min-hosts", "1", "--rendezvous-timeout", "5", "--max-restarts", "2"],
            job_args=[*LONG, "--backup-dir", str(tmp_path / "backup")])
        _wait_for_backup(tmp_path / "backup", launchers)
        hosts.kill(1)  # every process of host 1, its launcher included
        output = launchers[0].finish(400)
    assert launchers[0].process.returncode == 0, output
    log = _log(tmp_path, 0, attempt=0)
    assert "worker:1 (198.18.0.2:" in log or "/job:worker/replica:0/task:1" in log, log[-3000:]
    assert "198.18.0.2" in output and "after 1 restart(s)" in output, output
    # 1 worker on the global batch from the backup on: the same examples, summed in
    # another order.
    for got, want in zip(_weights(tmp_path, 0), two_hosts_uninterrupted, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_replaced_host_resumes_from_its_peers_in_memory_snapshot(tmp_path,
                                                                   two_hosts_uninterrupted):
    backup = tmp_path / "backup"
    job_args = [*LONG, "--backup-dir", str(backup), "--snapshot-freq", "1", "--progress"]
    with SimulatedHosts(2) as hosts:
        launchers = _launch(hosts, tmp_path, launcher_args=["--max-restarts", "1"],
                            job_args=job_args)
        _wait_for_backup(backup, launchers)
        hosts.kill(1)  # every process of host 1: its launcher and its snapshots' owner
        _wait_for(lambda: "restarting (1/1)" in launchers[0].output,
                  deadline=time.monotonic() + 60, launchers=launchers[:1])
        lost_at = int((tmp_path / "progress-0").read_text())
        shutil.rmtree(backup)  # nothing durable to resume from
        # A new machine in host 1's place: its launcher finds host 1's snapshots' owner
        # gone and deletes them, as a reboot would.
        [replacement] = _launch(hosts, tmp_path, launcher_args=["--max-restarts", "1"],
                                job_args=job_args, only=1, log_dir="logs-1-replaced")
        outputs = _finish([launchers[0], replacement])
    resumed = [int(line.split("resuming from step ")[1].split()[0])
               for output in outputs for line in output.splitlines()
               if "(in-memory snapshot)" in line]
    assert len(resumed) == 2 and abs(resumed[0] - lost_at) <= 1 and resumed[0] == resumed[1], (
        lost_at, outputs)
    for index in range(2):
        for got, want in zip(_weights(tmp_path, index), two_hosts_uninterrupted, strict=True):
            np.testing.assert_array_equal(got, want)


STRANGER_JOB = """
import sys
import numpy as np
from tf_distrib import transport
from tests import _stranger

role, directory = sys.argv[1], sys.argv[2]
store = transport.FileStore(directory)
if role == "stranger":
    replies = _stranger.send_garbage(store)
    assert len(replies) == 2 and all(r in (b"", None) for r in replies), replies
    sys.exit(0)
rank = int(role)
if rank == 1:  # the stranger's connections queue up at worker 0 before this one's
    store.get(_stranger.SENT, 60)
t = transport.connect(rank, ["worker:0", "worker:1"], sys.argv[3], store, secret=b"the job's",
                      timeout=60)
[total] = t.all_reduce([np.full(10, rank + 1.0, np.float32)])
print("sum", float(total[0]), "mode", t.mode, flush=True)
t.close()
"""


def test_a_host_without_the_secret_is_refused_and_logged(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(STRANGER_JOB)
    store = tmp_path / "store"
    store.mkdir()
    with SimulatedHosts(3) as hosts:
        workers = [hosts.run(i, [sys.executable, str(script), str(i), str(store),
                                 hosts.addresses[i]], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(2)]
        stranger = hosts.run(2, [sys.executable, str(script), "stranger", str(store)],
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        outputs = [p.communicate(timeout=120)[0] for p in [*workers, stranger]]
    assert [p.returncode for p in [*workers, stranger]] == [0, 0, 0], outputs
    assert all("sum 3.0 mode tcp" in output for output in outputs[:2]), outputs
    assert outputs[0].count("refused a connection: a connection from 198.18.0.3") == 2, outputs


def _log(out, host, attempt):
    """What host `host`'s workers printed in `attempt` (their log files)."""
    return "".join(p.read_text() for p in
                   sorted((out / f"logs-{host}" / f"attempt-{attempt}").glob("worker-*.log")))


def _wait_for_backup(directory, launchers, timeout=240):
    _wait_for(lambda: any(directory.glob("backup-*/manifest.json")),
              deadline=time.monotonic() + timeout, launchers=launchers)


def _wait_for(condition, deadline, launchers):
    while not condition():
        assert all(p.process.poll() is None for p in launchers), [p.output for p in launchers]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
