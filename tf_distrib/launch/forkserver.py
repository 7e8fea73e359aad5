"""Workers forked from a process that has already imported TensorFlow and Keras.

A fresh Python process spends seconds importing TensorFlow before it runs a line of
training code, per worker and per restart. With `preload`, one server process per
distinct environment imports both once and forks a child per worker: its own pid,
session, pipes, environment and working directory, its exit status reported through
the server. What it does not get is a fresh interpreter, so the server is keyed by the
whole environment except TF_CONFIG and the TF_DISTRIB_ variables, and a target that
sets TensorFlow's variables itself before importing it must not be preloaded. Linux
only. A server lives until `close_all()` or the launching process exits.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from tf_distrib.launch import liveness
from tf_distrib.launch.errors import LaunchError

#: Set to 1 to preload every launch that does not say otherwise.
ENV_PRELOAD = "TF_DISTRIB_PRELOAD"
#: Seconds a server may take to import TensorFlow and Keras before its first fork.
READY_TIMEOUT = 300.0
# Servers kept at once (each holds TensorFlow and Keras in memory).
_MAX_SERVERS = 4
_HEADER = struct.Struct("!I")
_REAP_SECONDS = 0.05


def check_supported() -> None:
    """Raises LaunchError where workers cannot be forked from a preloaded process."""
    if not sys.platform.startswith("linux"):
        raise LaunchError(f"preload forks workers and needs Linux; this is {sys.platform}. "
                          f"Launch without preload (--no-preload, or {ENV_PRELOAD}=0).")


def _server_env(env: Mapping[str, str]) -> dict[str, str]:
    """What of a worker's environment its server starts with: all but the variables that
    change from launch to launch and are read only after imports (pytest's changes
    with every test)."""
    return {k: v for k, v in env.items()
            if k not in ("TF_CONFIG", "PYTEST_CURRENT_TEST") and not k.startswith("TF_DISTRIB_")}


class ForkedProcess:
    """A worker forked by the server: the parts of `subprocess.Popen` the launcher uses.

    Attributes:
        pid: The worker's process id (it leads a session of its own).
        stdout, stderr: Binary pipes with the worker's output.
        returncode: Its exit status once reported (negative: the signal that ended it).
    """

    def __init__(self, pid: int, status: socket.socket, stdout, stderr):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None
        self._status = status
        self._received = b""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            self._receive(timeout=1.0 if left is None else min(left, 1.0))
        return self.returncode

    def _receive(self, timeout: float) -> None:
        ready, _, _ = select.select([self._status], [], [], timeout)
        if not ready:
            return
        try:
            chunk = self._status.recv(64)
        except ConnectionError:
            chunk = b""
        self._received += chunk
        if self._received.endswith(b"\n"):
            self.returncode = int(self._received)
        elif not chunk:
            # The server died: the worker was re-parented and its status is lost. Report
            # it once it is gone (or a zombie its new parent does not reap), as killed.
            if liveness.process_state(self.pid) in (None, "Z"):
                self.returncode = -signal.SIGKILL
            else:
                time.sleep(min(timeout, 0.1))
        if self.returncode is not None:
            self._status.close()


class ForkServer:
    """One server process: imports TensorFlow and Keras once, then forks workers.

    Args:
        python: The interpreter to run it with.
        env: Its environment, which every worker starts from.
    """

    def __init__(self, python: str, env: Mapping[str, str]):
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._stderr = tempfile.TemporaryFile()
        self._lock = threading.Lock()
        self._ready = False
        with theirs:
            # A session of its own: a Ctrl-C meant for the launcher must not take the
            # parent (and the exit statuses) of running workers with it.
            self.process = subprocess.Popen(
                # Not "-m": this module is also imported as part of tf_distrib.launch.
                [python, "-c", f"from {__name__} import main; main({theirs.fileno()})"],
                env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self._stderr, pass_fds=(theirs.fileno(),), start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> ForkedProcess:
        """Forks a worker that runs `argv` (python -m MODULE ... or python SCRIPT ...) in
        this process's working directory.

        Raises:
            LaunchError: the server could not start or fork.
        """
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            request = json.dumps({"argv": list(argv), "env": dict(env),
                                  "cwd": os.getcwd()}).encode()
            with open(os.devnull, "rb") as devnull, self._lock:
                try:
                    socket.send_fds(self._control, [_HEADER.pack(len(request)) + request],
                                    [devnull.fileno(), out_w, err_w, theirs.fileno()])
                    pid = self._reply()
                except ConnectionError:
                    raise self._exited() from None
        except BaseException:
            ours.close()
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
            theirs.close()
        return ForkedProcess(pid, ours, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))

    def _reply(self) -> int:
        timeout = 60.0 if self._ready else READY_TIMEOUT
        deadline = time.monotonic() + timeout
        received = b""
        while not received.endswith(b"\n"):
            ready, _, _ = select.select([self._control], [], [],
                                        max(0.0, min(1.0, deadline - time.monotonic())))
            chunk = self._control.recv(64) if ready else b""
            received += chunk
            if ready and not chunk:
                raise self._exited()
            if not ready and time.monotonic() >= deadline:
                raise LaunchError(f"The preload fork server did not fork a worker within "
                                  f"{timeout:g} s: {self._stderr_tail()}")
        self._ready = True
        return int(received)

    def _exited(self) -> LaunchError:
        try:
            status = f"exit status {self.process.wait(5)}"
        except subprocess.TimeoutExpired:
            status = "its control socket closed"
        return LaunchError(f"The preload fork server exited ({status}): "
                           f"{self._stderr_tail()}")

    def _stderr_tail(self, lines: int = 8) -> str:
        self._stderr.seek(0)
        tail = self._stderr.read().decode("utf-8", "replace").strip().splitlines()[-lines:]
        return ("its last lines:\n" + "\n".join(tail) if tail else "it printed nothing") + (
            f"\nLaunch without preload (--no-preload, or {ENV_PRELOAD}=0) to see the workers fail "
            "on their own.")

    def close(self, timeout: float = 10.0) -> None:
        """Stops the server (its running workers go on, re-parented; stop them first)."""
        self._control.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stderr.close()


_servers: dict[tuple, ForkServer] = {}
_servers_lock = threading.Lock()


def spawn(argv: Sequence[str], env: Mapping[str, str]) -> ForkedProcess:
    """Forks a worker from the server for `argv[0]` and `env`, starting it if needed."""
    check_supported()
    server_env = _server_env(env)
    key = (argv[0], tuple(sorted(server_env.items())))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            if server is not None:
                _servers.pop(key).close()
            elif len(_servers) >= _MAX_SERVERS:
                _servers.pop(next(iter(_servers))).close()
            atexit.unregister(close_all)  # so that it is registered once
            atexit.register(close_all)
            server = _servers[key] = ForkServer(argv[0], server_env)
    return server.spawn(argv, env)


def close_all() -> None:
    """Stops every fork server of this process."""
    with _servers_lock:
        while _servers:
            _servers.popitem()[1].close()


# The server's side. Everything below runs in the server process, then in each child.

def _serve(control: socket.socket) -> dict:
    """Forks a child per request until the control socket closes; returns, in a child,
    its request."""
    status: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([control], [], [], _REAP_SECONDS)
        _reap(status)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
        if not data:
            for sock in status.values():
                sock.close()
            sys.exit(0)
        while len(data) < _HEADER.size or len(data) < _HEADER.size + _length(data):
            data += control.recv(1 << 16)
        request = json.loads(data[_HEADER.size:])
        stdin, stdout, stderr, status_fd = fds
        sys.stdout.flush()
        sys.stderr.flush()
        # Out of the collector's sight: each full collection in a child (the last one at
        # its exit) would otherwise walk every object TensorFlow and Keras made here,
        # copying each page it touches. Measured: 2 workers' exits took ~2 s on 2 cores.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            control.close()
            for sock in status.values():
                sock.close()
            os.close(status_fd)
            os.setsid()
            for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
                os.dup2(fd, target)
                os.close(fd)
            return request
        for fd in (stdin, stdout, stderr):
            os.close(fd)
        status[pid] = socket.socket(fileno=status_fd)
        control.sendall(b"%d\n" % pid)


def _length(data: bytes) -> int:
    return _HEADER.unpack_from(data)[0]


def _reap(status: dict[int, socket.socket]) -> None:
    while status:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = status.pop(pid, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.sendall(b"%d\n" % os.waitstatus_to_exitcode(wait_status))
            sock.close()


def _run(request: dict) -> None:
    """Runs a request's argv as `python` would, in this (forked) interpreter."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    python_args = request["argv"][1:]
    if python_args[0] == "-m":
        sys.argv = [python_args[1], *python_args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(python_args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(python_args)
        sys.path[0] = os.path.dirname(os.path.abspath(python_args[0]))
        runpy.run_path(python_args[0], run_name="__main__")


def main(control_fd: int) -> None:
    """The server process: imports, then serves `control_fd`; in each child, runs its
    request's command."""
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    _run(_serve(socket.socket(fileno=control_fd)))
