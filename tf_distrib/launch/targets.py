"""What a worker runs: a script, a module (`-m pkg.mod`) or a Python function."""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence

import cloudpickle

from tf_distrib.launch.errors import LaunchError


@dataclasses.dataclass(frozen=True)
class Target:
    """A resolved target.

    Attributes:
        argv: The command every worker runs, before per-worker arguments.
        payload: For function targets, the file holding the pickled call.
    """

    argv: tuple[str, ...]
    payload: str | None = None

    @property
    def is_function(self) -> bool:
        return self.payload is not None

    def command(self, result_path: str | None) -> list[str]:
        return list(self.argv) + ([result_path] if self.is_function else [])


def resolve(target: str | Sequence[str] | Callable, args: Sequence, kwargs: Mapping | None,
            workdir: str) -> Target:
    """Turns `target` into the command a worker runs.

    Args:
        target: A script path, "-m pkg.module", ["-m", "pkg.module"], or a callable.
            Callables are pickled by value with cloudpickle, so functions defined in
            `__main__` or a notebook work.
        args: Command-line arguments for a script or module; positional arguments
            for a callable.
        kwargs: Keyword arguments for a callable (None for scripts and modules).
        workdir: A private directory for the pickled call.

    Raises:
        LaunchError: when the script does not exist or the target is of no known kind.
    """
    if callable(target):
        payload = os.path.join(workdir, "call.pkl")
        with open(payload, "wb") as f:
            # sys.path travels along so the child can import what the function
            # refers to by reference (modules of the caller's project).
            pickle.dump((list(sys.path),
                         cloudpickle.dumps((target, tuple(args), dict(kwargs or {})))), f)
        return Target((sys.executable, "-m", "tf_distrib.launch.run_function", payload),
                      payload)
    if kwargs:
        raise LaunchError("kwargs are for function targets; pass a script's options in args.")
    parts = target.split(None, 1) if isinstance(target, str) else list(target)
    if not parts:
        raise LaunchError("The launch target is empty; give a script path, '-m module' or "
                          "a function.")
    if parts[0] == "-m":
        if len(parts) != 2 or not parts[1].strip():
            raise LaunchError("'-m' needs a module name, e.g. '-m mypkg.train'.")
        return Target((sys.executable, "-m", parts[1].strip(), *map(str, args)))
    if not isinstance(target, str):
        raise LaunchError(f"Cannot launch {target!r}: give a script path, '-m module' or a "
                          "function.")
    if not os.path.isfile(target):
        raise LaunchError(f"Script {target!r} does not exist (looked in {os.getcwd()}).")
    return Target((sys.executable, target, *map(str, args)))


def read_result(path: str):
    """Returns what a function target returned, or None when it wrote nothing."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)
