"""A real Slurm on this machine for the tests: munged, slurmctld and one slurmd.

Everything lives in one private directory: a generated munge key and socket, a
generated slurm.conf (one node named "localhost" with 2 CPUs, partition "test"), the
daemons' state, spool and logs. Only `make system-deps` touches the system (it installs
Debian's slurm-wlm and munge). `stop()` cancels every job and stops the daemons.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from tf_distrib.cluster import free_ports

COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")
CONF = """\
ClusterName=tfdtest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CryptoType=crypto/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
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
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


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
    """munged + slurmctld + slurmd from `directory`; `env` is what the clients need."""

    def __init__(self, directory: str):
        self.dir = directory
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(directory, sub), exist_ok=True)
        self.conf = os.path.join(directory, "slurm.conf")
        ctld_port, slurmd_port = free_ports(2)
        with open(self.conf, "w") as f:
            f.write(CONF.format(dir=directory, ctld_port=ctld_port, slurmd_port=slurmd_port))
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        key = os.path.join(directory, "munge.key")
        self._run(["mungekey", "--create", "--keyfile", key, "--force"])
        self._run(["munged", f"--key-file={key}", f"--socket={directory}/munge.sock",
                   f"--pid-file={directory}/munged.pid", f"--log-file={directory}/munged.log",
                   f"--seed-file={directory}/munge.seed", "--force"])
        self._run(["slurmctld", "-f", self.conf])
        self._run(["slurmd", "-f", self.conf, "-N", "localhost"])
        deadline = time.monotonic() + 60
        while "idle" not in self.run(["sinfo", "-h", "-o", "%t"]).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError("Slurm's node did not become idle within 60 s:\n"
                                   + self.logs())
            time.sleep(0.5)

    def run(self, argv, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (output captured as text)."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60,
                              **kwargs)

    def sbatch(self, argv: list[str], cwd: str, env: dict | None = None) -> int:
        """Submits a batch job; returns its id."""
        done = subprocess.run(["sbatch", "--parsable", *argv], cwd=cwd, capture_output=True,
                              text=True, timeout=60, env={**self.env, **(env or {})})
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
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                with open(path) as f:
                    parts.append(f"--- {name}\n" + "".join(f.readlines()[-20:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancels every job, then stops slurmd, slurmctld and munged."""
        self.run(["scancel", "--partition=test"])
        deadline = time.monotonic() + 60
        while self.run(["squeue", "-h"]).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            _kill_from_pid_file(os.path.join(self.dir, f"{name}.pid"))

    def _run(self, argv) -> None:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr}"
                               + self.logs())


def _kill_from_pid_file(path: str, timeout: float = 10.0) -> None:
    try:
        with open(path) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
