"""The session's clean-up (tests/_leftovers.py): a stray process, a shared-memory segment
and the files of a killed process are found, removed and named."""

import os
import signal
import subprocess
import time

from tests import _leftovers
from tf_distrib.transport.shared_memory import SEGMENT_PREFIX


def test_what_a_session_leaves_is_named_and_removed(tmp_path):
    session = tmp_path / "session"
    session.mkdir()
    (session / "__autograph_generated_file0.py").write_text("# a killed worker's\n")
    env = {**os.environ, "TMPDIR": str(session)}
    stray = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    finished = subprocess.Popen(["sleep", "0.3"], env=env)
    deadline = time.monotonic() + 10
    while len(_leftovers.processes(str(session))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # until both have exec'd with the session's TMPDIR
    segment = f"/dev/shm/{SEGMENT_PREFIX}leftovers-test-{os.getpid()}"
    open(segment, "w").close()

    left = _leftovers.collect(str(session), since=time.time() - 60, grace=1)

    assert left == [f"process {stray.pid}: sleep 60", f"shared-memory segment {segment}"]
    assert stray.wait(10) == -signal.SIGKILL and finished.wait(10) == 0
    assert not os.path.exists(segment) and not session.exists()


def test_a_segment_older_than_the_session_is_not_its_own(tmp_path):
    segment = f"/dev/shm/{SEGMENT_PREFIX}leftovers-test-old-{os.getpid()}"
    open(segment, "w").close()
    try:
        assert segment not in _leftovers.segments(since=time.time() + 60)
        assert segment in _leftovers.segments(since=time.time() - 60)
    finally:
        os.unlink(segment)


def test_a_segment_that_another_program_holds_is_not_the_sessions(tmp_path):
    session = tmp_path / "session"
    session.mkdir()
    segment = f"/dev/shm/{SEGMENT_PREFIX}leftovers-test-held-{os.getpid()}"
    open(segment, "w").close()
    with open(segment) as held:  # another test session's worker, as far as this one sees
        holder = subprocess.Popen(["sleep", "60"], stdin=held)
    try:
        assert _leftovers.collect(str(session), since=time.time() - 60, grace=1) == []
        assert os.path.exists(segment)
        holder.kill()
        holder.wait(10)
        assert not _leftovers.held_elsewhere(segment, {os.getpid()})  # now a leftover
    finally:
        holder.kill()
        holder.wait(10)
        os.unlink(segment)
