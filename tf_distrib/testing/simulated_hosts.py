"""Simulated hosts on one machine, for multi-host tests and benchmarks.

Each host is a network namespace with its own address in 198.18.0.0/15 (RFC 2544), its
own hostname, /dev/shm and /etc/hosts, on one bridge, its link shaped to `rate` (tc
tbf). Needs root and iproute2, tc, unshare, nsenter (`unavailable()` says what is
missing); `close()` removes everything, as does the next `SimulatedHosts` after a crash.
Example:

```python
with SimulatedHosts(2, rate="1gbit") as hosts:
    worker = hosts.run(1, ["hostname"], stdout=subprocess.PIPE, text=True)
    print(worker.communicate()[0])      # host1
    hosts.partition(1)                  # host 1 is cut off ...
    hosts.heal(1)                       # ... and back
```
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence

#: Every simulated host's namespace name starts with this, then its creator's pid.
NAME_PREFIX = "tfdsim"
#: Host i's address is SUBNET.(i + 1); the bridge joins them in one /24.
SUBNET = "198.18.0"
_RATE = re.compile(r"^\d+(\.\d+)?[kmg]?bit$")
_instances = itertools.count()


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here, or None when they can."""
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (iproute2, util-linux)"
    if os.geteuid() != 0:
        return "simulated hosts need root (CAP_NET_ADMIN, CAP_SYS_ADMIN) for network namespaces"
    return None


class SimulatedHosts:
    """`n` hosts in network namespaces, linked through a bridge at `rate`.

    Args:
        n: How many hosts, 1 to 250.
        rate: Each host's link rate in both directions, as tc writes it ("10gbit",
            "1gbit", "500mbit"); None leaves the links unshaped. Defaults to "10gbit".

    Attributes:
        addresses: Host i's address ("198.18.0.<i + 1>").
        hostnames: Host i's hostname ("host<i>").

    Raises:
        RuntimeError: simulated hosts cannot be made here (`unavailable()` says why).
        ValueError: bad `n` or `rate`.

    Example:

    ```python
    with SimulatedHosts(2, rate="10gbit") as hosts:
        hosts.run(0, ["tf-distrib", "launch", "--hosts", ",".join(hosts.addresses),
                      "--host-index", "0", "train.py"])
    ```
    """

    def __init__(self, n: int, rate: str | None = "10gbit"):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 250:
            raise ValueError(f"n must be an integer from 1 to 250, got {n!r}.")
        if rate is not None and not _RATE.match(str(rate)):
            raise ValueError(f"rate must be like '10gbit', '1gbit' or '500mbit', got {rate!r}.")
        why = unavailable()
        if why:
            raise RuntimeError(why)
        remove_stale()
        self.rate = rate
        tag = f"{NAME_PREFIX}{os.getpid()}-{next(_instances)}"
        self._bridge = f"{tag}-br"
        self._hosts = [f"{tag}-h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.hostnames = [f"host{i}" for i in range(n)]
        self._inits: list[subprocess.Popen] = []
        self._processes: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self._bridge)
        _ip("-n", self._bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self._bridge, "link", "set", "br0", "up")
        for i, host in enumerate(self._hosts):
            _ip("netns", "add", host)
            _ip("-n", self._bridge, "link", "add", f"p{i}", "type", "veth", "peer", "name",
                "eth0", "netns", host)
            _ip("-n", self._bridge, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", host, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
            _ip("-n", host, "link", "set", "lo", "up")
            if self.rate is not None:
                for namespace, device in ((host, "eth0"), (self._bridge, f"p{i}")):
                    _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
                         "rate", self.rate, "burst", "1mb", "latency", "5ms")
        # Every host resolves every host's name, as on a cluster (Slurm's node lists
        # hold names). The file is bind-mounted over /etc/hosts in each host's mount
        # namespace, where the mount keeps it after the name is gone.
        with tempfile.NamedTemporaryFile("w", prefix="tf_distrib_hosts_") as hosts_file:
            hosts_file.write("127.0.0.1 localhost\n::1 localhost\n" + "".join(
                f"{address} {name}\n" for address, name in zip(self.addresses, self.hostnames,
                                                               strict=True)))
            hosts_file.flush()
            for host, hostname in zip(self._hosts, self.hostnames, strict=True):
                self._inits.append(self._start_init(host, hostname, hosts_file.name))

    @staticmethod
    def _start_init(namespace: str, hostname: str, hosts_file: str) -> subprocess.Popen:
        """A process that holds the host's hostname, /etc/hosts and /dev/shm; others join it."""
        init = subprocess.Popen(
            ["ip", "netns", "exec", namespace, "unshare", "--uts", "--mount",
             "--propagation", "private", "sh", "-c",
             'hostname "$1" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm '
             '&& mount --bind "$2" /etc/hosts && echo ready && exec sleep 2147483647',
             "sh", hostname, hosts_file],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        ready = init.stdout.readline()  # bounded: sh either says ready or exits
        if ready.strip() != "ready":
            init.kill()
            raise RuntimeError(f"could not set up simulated host {hostname}: "
                               f"{init.stderr.read().strip()}")
        return init

    def run(self, i: int, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Starts `argv` on host `i` (in a session of its own); `close()` stops it.

        Args:
            i: The host's index.
            argv: The command.
            **popen_kwargs: For `subprocess.Popen` (env, cwd, stdout, ...); `cwd`
                defaults to this process's working directory, as for `Popen`.
        """
        init = self._inits[self._check(i)]
        # Entering a mount namespace moves to its root directory: nsenter moves back.
        cwd = os.path.abspath(popen_kwargs.pop("cwd", None) or os.getcwd())
        process = subprocess.Popen(
            ["nsenter", f"--target={init.pid}", "--net", "--uts", "--mount", f"--wd={cwd}",
             "--", *argv], start_new_session=True, **popen_kwargs)
        with self._lock:
            self._processes.append(process)
        return process

    def partition(self, i: int) -> None:
        """Cuts host `i` off the network (its link goes down); `heal(i)` undoes it."""
        _ip("-n", self._hosts[self._check(i)], "link", "set", "eth0", "down")

    def heal(self, i: int) -> None:
        """Brings host `i`'s link back up (its address and route come back with it)."""
        _ip("-n", self._hosts[self._check(i)], "link", "set", "eth0", "up")

    def kill(self, i: int) -> None:
        """SIGKILLs every process of host `i`, as when the host fails (its network stays)."""
        for pid in _namespace_pids(self._hosts[self._check(i)]):
            if pid != self._inits[i].pid:
                _kill(pid)

    def close(self) -> None:
        """Stops every process on the hosts and removes the hosts and the bridge."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for process in self._processes:
            _kill_group(process)
        for namespace in [*self._hosts, self._bridge]:
            _remove_namespace(namespace)
        for process in [*self._processes, *self._inits]:
            _kill(process.pid)
            process.wait()

    def _check(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self._hosts):
            raise IndexError(f"host index must be in 0..{len(self._hosts) - 1}, got {i!r}.")
        if self._closed:
            raise RuntimeError("these simulated hosts are closed.")
        return i


def remove_stale() -> list[str]:
    """Removes simulated hosts whose creating process is gone (after a crash).

    Returns:
        The namespaces removed.
    """
    removed = []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.match(rf"^{NAME_PREFIX}(\d+)-", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _remove_namespace(name)
            removed.append(name)
    return removed


def namespaces() -> list[str]:
    """The simulated hosts' namespaces that exist now (every creator's)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines()
            if line.startswith(NAME_PREFIX)]


def _remove_namespace(namespace: str) -> None:
    for pid in _namespace_pids(namespace):
        _kill(pid)
    deadline = time.monotonic() + 10
    while _namespace_pids(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    # Deleting the namespace deletes its end of every veth, and so the other end.
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def _namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split()]


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
