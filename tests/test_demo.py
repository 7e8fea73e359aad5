"""`make demo` end to end: 2 workers, one killed, restarted, resumed, summary printed."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess


def test_demo_survives_the_injected_failure_and_prints_the_summary():
    done = subprocess.run([sys.executable, "-m", "tf_distrib.demo", "--epochs", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "attempt 0: worker 1 failed with signal SIGKILL" in out
    assert "attempt 1: all workers finished, resumed from the backup at step 100" in out
    assert "Summary (1 restart(s))" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("worker:")]
    assert [r[0] for r in rows] == ["worker:0", "worker:1"]
    assert rows[0][3] == rows[1][3]  # identical final loss on both workers
    assert float(rows[0][4]) > 0.9   # accuracy
    # The whole story (the kill, the culprit, the resume, the table) in a screenful.
    console = (done.stdout + done.stderr).splitlines()
    assert len(console) <= 30, "\n".join(console)
    assert sum("root cause: worker 1 (attempt 0, signal SIGKILL)" in line
               for line in console) == 1
    assert not [line for line in console if "Traceback" in line or "oneDNN" in line]
