"""What a test session must not leave behind, found and removed at its end.

Every process the tests start inherits the session's private TMPDIR. That is how their
stray processes are found, in any process group or network namespace, and it collects
what a killed process leaves in its temporary directory (TensorFlow's autograph removes
its generated modules only at a clean exit; a launcher keeps its log directory there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

from tf_distrib.launch import liveness, snapshots
from tf_distrib.testing import simulated_hosts
from tf_distrib.transport.shared_memory import SEGMENT_PREFIX


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (dead, not yet reaped)."""
    return liveness.process_state(pid) not in (None, "Z")


def processes(tmpdir: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process, but this one, started with `tmpdir`
    as its TMPDIR."""
    marker = f"TMPDIR={tmpdir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it exited meanwhile, or is a zombie
            continue
        found.append((int(entry), command))
    return found


def segments(since: float, directory: str = "/dev/shm") -> list[str]:
    """tf_distrib's shared-memory segments created at or after `since` (a time.time())."""
    found = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        try:
            if name.startswith(SEGMENT_PREFIX) and os.stat(path).st_ctime >= since:
                found.append(path)
        except FileNotFoundError:
            continue
    return found


def held_elsewhere(path: str, session: set[int]) -> bool:
    """Whether a live process outside `session` (pids) holds `path`: maps or opens it (a
    transport's segment, a snapshot's files), or is the launcher whose snapshot directory
    it is (the name holds its pid). Such a segment is another program's, in use (a test
    session beside this one), not this session's leftover."""
    name = os.path.basename(path)
    if name.startswith(snapshots.PREFIX):
        pid = name[len(snapshots.PREFIX):].partition("-")[0]
        if pid.isdigit() and int(pid) not in session and alive(int(pid)):
            return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in session:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                if path in f.read():
                    return True
            descriptors = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # it exited meanwhile, or is not ours to read
            continue
        for fd in descriptors:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(path):
                    return True
    return False


def collect(tmpdir: str, since: float, grace: float = 10.0) -> list[str]:
    """Removes what the session left behind and says what it was.

    Waits up to `grace` seconds for the session's processes to exit, then kills those
    left; removes its segments (those made since `since` that no process outside the
    session holds), the simulated hosts of its killed processes and `tmpdir`.
    Simulated hosts this process still has open are named; their `atexit` removes them.

    Args:
        tmpdir: The TMPDIR every process of the session inherited.
        since: When the session started (a time.time()).
        grace: Seconds that processes still exiting get. Defaults to 10.

    Returns:
        One line per thing that was left: a process, a segment, a namespace.
    """
    deadline = time.monotonic() + grace
    while processes(tmpdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    left, strays = [], processes(tmpdir)
    for pid, command in strays:
        left.append(f"process {pid}: {command}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    session = {os.getpid(), *(pid for pid, _ in strays)}
    for path in segments(since):
        if held_elsewhere(path, session):
            continue
        left.append(f"shared-memory segment {path}")
        if os.path.isdir(path):  # a launch's in-memory snapshots
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    # Another program's simulated hosts are its own business; this session's open ones
    # close when it exits (atexit), those of its dead processes are removed here.
    stale = simulated_hosts.remove_stale()
    left += [f"network namespace {name} (its creator was killed)" for name in stale]
    left += [f"network namespace {name} (still open)" for name in simulated_hosts.namespaces()
             if name.startswith(f"{simulated_hosts.NAME_PREFIX}{os.getpid()}-")]
    shutil.rmtree(tmpdir, ignore_errors=True)
    return left
