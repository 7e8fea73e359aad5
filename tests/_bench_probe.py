"""A benchmark that measures nothing: where a benchmark's temporary files go (test_bench)."""

import os
import subprocess
import sys
import tempfile


def run(options) -> dict:
    """Makes a temporary directory here and in a child process, as launches do."""
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return {"mine": tempfile.mkdtemp(), "child": child, "TMPDIR": os.environ.get("TMPDIR")}
