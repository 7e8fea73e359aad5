"""Key-value stores the workers rendezvous through: TensorFlow's coordination service, or files.

Under MultiWorkerMirroredStrategy every worker already talks to TensorFlow's
coordination service (task 0 runs it), so the transport needs no configuration of
its own: each worker publishes its address there and reads its peers'. `FileStore`
does the same through a shared directory, for programs without a TensorFlow cluster.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Protocol


class Store(Protocol):
    """What the transport's rendezvous needs from a key-value store."""

    def set(self, key: str, value: str) -> None:
        """Publishes `value` under `key` (each key is set once)."""

    def get(self, key: str, timeout: float) -> str:
        """The value of `key`, waiting up to `timeout` seconds; TimeoutError after that."""


class CoordinationServiceStore:
    """TensorFlow's coordination service (the key-value store MWMS workers share)."""

    def set(self, key: str, value: str) -> None:
        from tf_distrib import _compat

        _compat.coordination_service().set_config_key_value(key, value)

    def get(self, key: str, timeout: float) -> str:
        import tensorflow as tf

        from tf_distrib import _compat

        try:
            return _compat.coordination_service().get_config_key_value(
                key, max(1, int(timeout * 1000)))
        except tf.errors.DeadlineExceededError:
            raise TimeoutError(f"no value for {key!r} after {timeout:g} s") from None


class FileStore:
    """A directory every worker can read and write: one file per key.

    Args:
        directory: The shared directory.
    """

    def __init__(self, directory: str):
        self.directory = directory

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key.replace("/", "__"))

    def set(self, key: str, value: str) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(value)
        os.replace(tmp, self._path(key))

    def get(self, key: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(self._path(key)) as f:
                    return f.read()
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no value for {key!r} after {timeout:g} s") from None
                time.sleep(0.02)
