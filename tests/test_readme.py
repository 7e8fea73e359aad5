"""The README's quick start runs as written, and the README stays a front page."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_is_a_front_page():
    assert README.stat().st_size <= 8 * 1024


@pytest.mark.multiprocess
def test_quick_start_runs(tmp_path):
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("/tmp/tf_distrib_backup", str(tmp_path / "backup"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={"TF_CPP_MIN_LOG_LEVEL": "2",
                                            "PATH": "/usr/bin:/bin",
                                            "TMPDIR": os.environ["TMPDIR"]})
    assert done.returncode == 0, done.stderr[-3000:]
