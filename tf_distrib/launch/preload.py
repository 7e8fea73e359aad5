"""Whether a launch's workers may be forked from a preloaded process, and why not.

A preloaded worker (`forkserver`) has imported TensorFlow and Keras before its target
runs. A target that sets, before it imports them, an environment variable they read
when they load (TF_ENABLE_ONEDNN_OPTS, TF_CPP_MIN_LOG_LEVEL, KERAS_BACKEND, OMP_*, ...)
would silently lose that setting. `reason_not_to` reads the target's code without running
it (a script, a module's file, a function's source) and names the first such assignment
that comes before the code's first import of TensorFlow or Keras; launches preload by
default where it finds none, and start fresh processes, saying why, where it does.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
from collections.abc import Callable, Sequence

# Variables read when TensorFlow, Keras or their libraries load (prefixes), and modules
# whose import loads them.
_READ_AT_LOAD = ("TF_", "KERAS_", "CUDA_", "XLA_", "OMP_", "KMP_", "MKL_", "ONEDNN_",
                 "DNNL_", "OPENBLAS_", "NCCL_", "PYTHONHASHSEED", "LD_")
_LOADERS = ("tensorflow", "keras", "tf_keras")
# Variables of those prefixes that are read only when training starts, not as TensorFlow
# loads: setting them first is fine.
_READ_LATER = ("TF_CONFIG", "TF_DISTRIB_")


def reason_not_to(target: str | Sequence[str] | Callable) -> str | None:
    """Why the workers of `target` must start as fresh processes, or None when they may
    be forked from a preloaded process.

    Args:
        target: What `launch()` runs: a script path, "-m module" (or ["-m", module]), or a
            function.

    Example:

    ```python
    reason_not_to("train.py")   # "train.py sets TF_ENABLE_ONEDNN_OPTS at line 3 ..."
    ```
    """
    if not sys.platform.startswith("linux"):
        return f"preloading forks workers, which needs Linux; this is {sys.platform}"
    source, name = _source(target)
    if source is None:
        return f"the code of {name} cannot be read to check what it sets before TensorFlow"
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # a fresh worker would fail the same way: nothing to protect
    loads = min((n.lineno for n in ast.walk(tree) if _imports_a_loader(n)), default=None)
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
        variable = _sets_a_variable_read_at_load(node)
        if variable is not None and (loads is None or node.lineno < loads):
            return (f"{name} sets {variable} at line {node.lineno} before it imports "
                    "TensorFlow, which a preloaded worker has imported already")
    return None


def _source(target) -> tuple[str | None, str]:
    """The target's code and how to name it; None for code that cannot be found."""
    if callable(target):
        name = f"{getattr(target, '__qualname__', repr(target))}()"
        try:
            return textwrap.dedent(inspect.getsource(target)), name
        except (OSError, TypeError):
            return None, name
    parts = target.split(None, 1) if isinstance(target, str) else list(target)
    if parts and parts[0] == "-m" and len(parts) == 2:
        path = _module_file(parts[1].strip())
        name = f"module {parts[1].strip()}"
    else:
        path = name = target
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), name
    except (OSError, TypeError, UnicodeDecodeError):
        return None, name


def _module_file(module: str) -> str | None:
    """The file `python -m module` would run, found without importing anything."""
    relative = module.replace(".", os.sep)
    for directory in [os.getcwd(), *sys.path]:
        for candidate in (relative + ".py", os.path.join(relative, "__main__.py")):
            path = os.path.join(directory or os.getcwd(), candidate)
            if os.path.isfile(path):
                return path
    return None


def _imports_a_loader(node) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in _LOADERS for a in node.names)
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _LOADERS


def _sets_a_variable_read_at_load(node) -> str | None:
    """The variable `node` sets in the environment when it is one TensorFlow reads as it
    loads ("an unknown variable" for a name that is not a literal), else None."""
    key = None
    if isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
        targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
        keys = [t.slice for t in targets if isinstance(t, ast.Subscript) and _is_environ(t.value)]
        if not keys:
            return None
        key = keys[0]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        function = node.func
        if function.attr in ("setdefault", "update", "pop") and _is_environ(function.value):
            key = node.args[0] if node.args else None
        elif function.attr == "putenv" and _is_name(function.value, "os"):
            key = node.args[0] if node.args else None
        else:
            return None
        if function.attr == "update":  # a mapping of any variables
            return "environment variables (os.environ.update)"
    else:
        return None
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        loading = key.value.startswith(_READ_AT_LOAD) and not key.value.startswith(_READ_LATER)
        return key.value if loading else None
    return "an environment variable named at run time"


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and _is_name(node.value, "os")) or _is_name(node, "environ")


def _is_name(node, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name
