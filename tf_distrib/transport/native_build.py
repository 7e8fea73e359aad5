"""Builds the native ops once per machine and remembers a failed build.

The ops (`native_sum.cc`: the shared-memory all-reduce; `native_exchange.cc`: small
all-reduces over TCP; `cross_device/powersgd_ops.cc`: PowerSGD's arithmetic; with their
headers `native_control.h` and `native_update.h`) are compiled into one library
against the installed TensorFlow on first use, into `TF_DISTRIB_CACHE_DIR` (default
`$XDG_CACHE_HOME/tf_distrib`, else ~/.cache/tf_distrib). Its cache key covers the sources
and the header, TensorFlow's version and flags, the compiler (path, size, modification
time), the machine and the C library, so a shared home directory never serves a library
built elsewhere. Workers that start together take one lock: one builds, the others wait
and load its library. A failed build is written beside the library with its reason and
not tried again until one of those inputs changes or `tf-distrib doctor --rebuild` asks.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import time

from tf_distrib import contract

_PACKAGE = os.path.dirname(os.path.dirname(__file__))
SOURCES = (os.path.join(_PACKAGE, "transport", "native_sum.cc"),
           os.path.join(_PACKAGE, "transport", "native_exchange.cc"),
           os.path.join(_PACKAGE, "cross_device", "powersgd_ops.cc"))
HEADERS = (os.path.join(_PACKAGE, "transport", "native_control.h"),
           os.path.join(_PACKAGE, "transport", "native_update.h"))
# A first build takes ~10 s on two cores (~20 s on one); its peers wait for it
# (`connect`'s timeout).
BUILD_TIMEOUT_SECONDS = 60.0
# No fused multiply-adds: the op's SGD step rounds as TensorFlow's multiply and subtract.
CXXFLAGS = ("-shared", "-fPIC", "-O3", "-ffp-contract=off", "-w")


class BuildFailed(OSError):
    """The op cannot be built here; the message names the cause and the fix."""


def compiler() -> str | None:
    """The C++ compiler that builds the op (`$CXX`, default `c++`), or None if missing."""
    return shutil.which(os.environ.get("CXX", "c++"))


def library_path(flags: list[str], tf_version: str, *, rebuild: bool = False) -> str:
    """The op's shared library for these TensorFlow flags, built (once) if missing.

    Args:
        flags: TensorFlow's compile and link flags (`tf.sysconfig`).
        tf_version: TensorFlow's version, part of the cache key.
        rebuild: Forget a remembered failure and a built library, and build again.
            Defaults to False.

    Returns:
        The path of the built library.

    Raises:
        BuildFailed: no compiler, a compile error (its first error line), a build
            remembered as failed, or a cache directory that cannot be written.
    """
    cxx = compiler()
    if cxx is None:
        raise BuildFailed(f"no C++ compiler: {os.environ.get('CXX', 'c++')} is not on PATH; "
                          "install g++ or point CXX at a C++ compiler")
    flags = [*CXXFLAGS, *flags]
    path = os.path.join(contract.cache_dir(), f"native_sum-{_key(cxx, flags, tf_version)}.so")
    failed = path + ".failed"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "w")  # held across the build below
    except OSError as e:
        raise BuildFailed(f"cannot write the cache directory {os.path.dirname(path)} "
                          f"({e.strerror}); set {contract.ENV_CACHE_DIR} to a writable "
                          "directory") from None
    with lock:
        # Workers of one host start together: one builds, the others wait for its result.
        _lock(lock, path)
        if rebuild:
            for stale in (path, failed):
                if os.path.exists(stale):
                    os.unlink(stale)
        if os.path.exists(path):
            return path
        if os.path.exists(failed):
            with open(failed, encoding="utf-8") as f:
                raise BuildFailed(f"{f.read().strip()} (remembered in {failed}; "
                                  "`tf-distrib doctor --rebuild` tries again)")
        reason = _compile(cxx, flags, path)
        if reason is not None:
            with open(failed, "w", encoding="utf-8") as f:
                f.write(reason)
            raise BuildFailed(reason)
    return path


def _key(cxx: str, flags: list[str], tf_version: str) -> str:
    """What decides whether a built library (or a failure) still holds, as 16 hex digits."""
    sources = [pathlib.Path(source).read_bytes() for source in (*SOURCES, *HEADERS)]
    stat = os.stat(cxx)
    parts = [*sources, tf_version, os.path.realpath(cxx), stat.st_size, stat.st_mtime_ns,
             platform.machine(), *platform.libc_ver(), *flags]
    return hashlib.sha256(b"\0".join(p if isinstance(p, bytes) else str(p).encode()
                                     for p in parts)).hexdigest()[:16]


def _compile(cxx: str, flags: list[str], path: str) -> str | None:
    """Compiles the ops into `path`: each source in a process of its own, at once (each
    takes ~10 s, mostly TensorFlow's headers), then links them. None when it did, else
    why not (its first error line)."""
    partial = f"{path}.{os.getpid()}.tmp"
    objects = [f"{partial}.{i}.o" for i in range(len(SOURCES))]
    deadline = time.monotonic() + BUILD_TIMEOUT_SECONDS
    processes = []
    try:
        processes = [subprocess.Popen([cxx, "-c", source, "-o", obj, *flags],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)
                     for source, obj in zip(SOURCES, objects, strict=True)]
        # Every compile is waited for (a failed one does not stop the others): the same
        # runs whatever fails first.
        outputs = [p.communicate(timeout=max(deadline - time.monotonic(), 0))[1]
                   for p in processes]
        failures = [(p.returncode, text) for p, text in zip(processes, outputs, strict=True)
                    if p.returncode != 0]
        if not failures:
            link = subprocess.run([cxx, *objects, "-o", partial, *flags], capture_output=True,
                                  text=True, timeout=max(deadline - time.monotonic(), 0))
            failures = [(link.returncode, link.stderr)] if link.returncode != 0 else []
        if failures:
            status, text = failures[0]
            lines = text.strip().splitlines()
            first = next((line for line in lines if "error" in line.lower()),
                         lines[0] if lines else "no output")
            return (f"{os.path.basename(cxx)} failed to compile the native ops (exit status "
                    f"{status}): {first.strip()}")
        os.replace(partial, path)
        return None
    except subprocess.TimeoutExpired:
        return f"{os.path.basename(cxx)} took over {BUILD_TIMEOUT_SECONDS:g} s to compile"
    except OSError as e:
        return f"{cxx} could not run ({e.strerror or e})"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for leftover in (partial, *objects):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _lock(lock, path: str) -> None:
    """Takes the build's lock, waiting for another process's build as long as one may take."""
    deadline = time.monotonic() + BUILD_TIMEOUT_SECONDS + 10
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise BuildFailed(f"another process has held {path}.lock for over "
                                  f"{BUILD_TIMEOUT_SECONDS + 10:g} s") from None
            time.sleep(0.1)
