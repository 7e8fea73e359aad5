"""A real Slurm on this machine for the tests: munged, slurmctld and a slurmd per node.

Everything lives in one private directory: a generated munge key and socket, a
generated slurm.conf (partition "test"), the daemons' state, spool and logs. The nodes:
this machine as one node named "localhost" with 2 CPUs, or simulated hosts
(`tf_distrib.testing.simulated_hosts`), one node of 1 CPU per host, named by its hostname, with
munged, slurmctld, the clients and the batch script on host 0 (munged's socket is a file
every host sees). Only `make system-deps` touches the system (it installs
Debian's slurm-wlm and munge). `stop()` cancels every job and stops the daemons.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time

from tests._leftovers import alive
from tf_distrib.cluster import free_ports

COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")
CONF = """\
ClusterName=tfdtest
SlurmctldHost={controller}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CryptoType=crypto/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
KillWait=30
{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _cgroup_mounts() -> str:
    """A shell command that mounts /sys/fs/cgroup as this machine has it (v1, v2 or both)."""
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[:4] for line in f]
    return " && ".join(
        f"mkdir -p {point} && mount -t {kind} -o {options} {source} {point}"
        for source, point, kind, options in mounts
        if point == "/sys/fs/cgroup" or point.startswith("/sys/fs/cgroup/"))


def slurm_port_base(tasks_per_node: int) -> int:
    """A TF_DISTRIB_SLURM_PORT_BASE whose `tasks_per_node` ports are free (base + local id)."""
    for _ in range(50):
        base = free_ports(1)[0]
        try:
            for port in range(base, base + tasks_per_node):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"found no {tasks_per_node} consecutive free ports")


def missing() -> str | None:
    """Why a real Slurm cannot run here, or None."""
    absent = [name for name in COMMANDS if shutil.which(name) is None]
    if absent:
        return (f"a real Slurm: {', '.join(absent)} not installed (`make system-deps` installs "
                "Debian's slurm-wlm and munge, as root)")
    if os.geteuid() != 0:
        return "a real Slurm: root, to run slurmd"
    return None


class Slurm:
    """munged + slurmctld + slurmd from `directory`; `env` is what the clients need.

    Args:
        directory: Where everything goes.
        hosts: `SimulatedHosts` to make the nodes of, or None: this machine, one node.
    """

    def __init__(self, directory: str, hosts=None):
        self.dir, self._hosts = directory, hosts
        os.makedirs(os.path.join(directory, "state"), exist_ok=True)
        if hosts is None:
            nodes = [("localhost", "127.0.0.1", 2)]
        else:
            nodes = [(name, address, 1)
                     for name, address in zip(hosts.hostnames, hosts.addresses, strict=True)]
        self.nodes = [name for name, _, _ in nodes]
        for name in self.nodes:
            os.makedirs(os.path.join(directory, f"spool-{name}"), exist_ok=True)
        self.conf = os.path.join(directory, "slurm.conf")
        ctld_port, slurmd_port = free_ports(2)
        with open(self.conf, "w") as f:
            f.write(CONF.format(
                dir=directory, ctld_port=ctld_port, slurmd_port=slurmd_port,
                controller=f"{nodes[0][0]}({nodes[0][1]})",
                nodes="".join(f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN\n"
                              for name, address, cpus in nodes)))
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        try:
            self._start_daemons()
        except BaseException:
            self._stop_daemons()
            raise

    def _start_daemons(self) -> None:
        directory, key = self.dir, os.path.join(self.dir, "munge.key")
        self._start(0, ["mungekey", "--create", "--keyfile", key, "--force"])
        self._start(0, ["munged", f"--key-file={key}", f"--socket={directory}/munge.sock",
                        f"--pid-file={directory}/munged.pid",
                        f"--log-file={directory}/munged.log",
                        f"--seed-file={directory}/munge.seed", "--force"])
        if self._hosts is not None:
            # slurmd needs the cgroup file systems, which `ip netns exec` leaves behind with
            # the machine's /sys: each host mounts the same hierarchies.
            mounts = _cgroup_mounts()
            for i in range(len(self.nodes)):
                self._start(i, ["sh", "-c", mounts])
        self._start(0, ["slurmctld", "-f", self.conf])
        for i, name in enumerate(self.nodes):
            self._start(i, ["slurmd", "-f", self.conf, "-N", name])
        deadline = time.monotonic() + 60
        while self.run(["sinfo", "-h", "-o", "%t"]).stdout.split() != ["idle"]:
            if time.monotonic() > deadline:
                raise RuntimeError("Slurm's nodes did not become idle within 60 s:\n"
                                   + self.logs())
            time.sleep(0.5)

    def run(self, argv, env: dict | None = None, cwd: str | None = None,
            node: int = 0) -> subprocess.CompletedProcess:
        """A command on a node (a Slurm client against this cluster), output captured."""
        env = {**self.env, **(env or {})}
        if self._hosts is None:
            return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                                  timeout=60)
        process = self._hosts.run(node, argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        out, err = process.communicate(timeout=60)
        return subprocess.CompletedProcess(argv, process.returncode, out, err)

    def sbatch(self, argv: list[str], cwd: str, env: dict | None = None) -> int:
        """Submits a batch job; returns its id."""
        done = self.run(["sbatch", "--parsable", *argv], env=env, cwd=cwd)
        if done.returncode:
            raise RuntimeError(f"sbatch failed: {done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        text = self.run(["scontrol", "show", "job", str(job_id), "--oneliner"]).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait(self, job_id: int, timeout: float, until=None) -> dict[str, str]:
        """Polls the job until `until(job)` holds, by default until it has ended."""
        until = until or (lambda job: job.get("JobState") in
                          ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('JobState')} after "
                                   f"{timeout:g} s:\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", *(f"slurmd-{node}.log" for node in self.nodes)):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                with open(path) as f:
                    parts.append(f"--- {name}\n" + "".join(f.readlines()[-20:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancels every job, waits for their step daemons, then stops slurmd, slurmctld
        and munged."""
        self.run(["scancel", "--partition=test"])
        deadline = time.monotonic() + 60
        # A job leaves the queue before its slurmstepd (one per step, on its node) exits.
        while ((self.run(["squeue", "-h"]).stdout.strip()
                or subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True).stdout)
               and time.monotonic() < deadline):
            time.sleep(0.5)
        self._stop_daemons()

    def _stop_daemons(self) -> None:
        # Each takes 1-2 s to exit: the nodes' slurmd together, then the controller and
        # munged together (a slurmd may still report to them as it goes).
        for names in ([f"slurmd-{node}" for node in self.nodes], ["slurmctld", "munged"]):
            _stop_from_pid_files([os.path.join(self.dir, f"{name}.pid") for name in names])

    def _start(self, node: int, argv) -> None:
        """Runs `argv` on a node (a daemon forks into the background), or raises."""
        done = self.run(argv, node=node)
        if done.returncode:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr}"
                               + self.logs())


def _stop_from_pid_files(paths: list[str], timeout: float = 10.0) -> None:
    """SIGTERM to every daemon named in `paths`, then SIGKILL to those alive `timeout` later."""
    pids = []
    for path in paths:
        try:
            with open(path) as f:
                pid = int(f.read().strip())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):  # no pid file, or the daemon is gone already
            continue
        pids.append(pid)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = [pid for pid in pids if alive(pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
