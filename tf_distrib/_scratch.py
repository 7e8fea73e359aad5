"""Temporary files that others make, kept in a directory of their own and removed after."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def scratch_tempdir(prefix: str, *, children: bool = False) -> Iterator[str]:
    """Points `tempfile`'s directory at a new one for the block, then removes it.

    For code that leaves temporary files behind and takes no directory for them (TFDS,
    launches' log directories); what it made goes with the block. The previous
    directory is restored afterwards.

    Args:
        prefix: The scratch directory's name prefix.
        children: Whether child processes started in the block use it too (TMPDIR).
            Defaults to False: this process only.

    Example:

    ```python
    with scratch_tempdir("tf_distrib_tfds_"):
        builder = Builder(data_dir=data_dir)
    ```
    """
    saved_environ, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        tempfile.tempdir = scratch
        if children:
            os.environ["TMPDIR"] = scratch
        try:
            yield scratch
        finally:
            tempfile.tempdir = saved_tempdir
            if children:
                if saved_environ is None:
                    os.environ.pop("TMPDIR", None)
                else:
                    os.environ["TMPDIR"] = saved_environ
