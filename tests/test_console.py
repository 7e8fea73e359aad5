"""The launcher's console: start-up noise hidden, repeats collapsed, consequences folded."""

import io
import os
import re
import time

import pytest

from tf_distrib.launch import console as console_lib
from tf_distrib.launch import launch

NOISE_LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    "I0000 00:00:1796141593.129487   31668 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.\n",
    "E0000 00:00:1796141419.270405   25945 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n",
    "I0000 00:00:1796141593.129082   31668 port.cc:153] oneDNN custom operations are on. You "
    "may see slightly different numerical results.\n",
]
CONSEQUENCE = """Traceback (most recent call last):
  File "train.py", line 3, in <module>
    model.fit(dataset)
tensorflow.python.framework.errors_impl.UnknownError: Graph execution error:

Detected at node sgd/tf_distrib_all_reduce defined at (most recent call last):
  File "threading.py", line 1002, in _bootstrap

PeerLostError: worker:1 (127.0.0.1:46015) closed the connection: it exited or was killed.
"""
ROOT_CAUSE = """Traceback (most recent call last):
  File "train.py", line 3, in <module>
    load(path)
FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'
"""


def condensed(writes, workers=(0, 1), verbose=False):
    out, err = io.StringIO(), io.StringIO()
    console = console_lib.Console(list(workers), out, err, verbose=verbose)
    for worker, stream, line in writes:
        console.write(worker, stream, line)
    console.close()
    return out.getvalue(), err.getvalue()


def test_startup_noise_is_hidden_and_unknown_lines_pass():
    _, err = condensed([(w, "stderr", line) for w in (0, 1) for line in NOISE_LINES]
                       + [(1, "stderr", "something TensorFlow never said\n")])
    assert err == "[worker 1] something TensorFlow never said\n"


def test_a_line_from_both_workers_at_once_is_shown_once_marked_with_both():
    out, _ = condensed([(0, "stdout", "epoch 1 done\n"), (1, "stdout", "epoch 1 done\n"),
                        (1, "stdout", "only mine\n")])
    assert out == "[workers 0-1] epoch 1 done\n[worker 1] only mine\n"


def test_the_same_line_far_apart_in_time_is_shown_twice():
    out, err = io.StringIO(), io.StringIO()
    console = console_lib.Console([0, 1], out, err)
    console.write(0, "stdout", "saved\n")
    time.sleep(console_lib.WINDOW * 3)
    console.write(1, "stdout", "saved\n")
    console.close()
    assert out.getvalue() == "[worker 0] saved\n[worker 1] saved\n"


def test_keras_progress_of_other_workers_is_hidden():
    lines = ["Epoch 1/3\n", "32/32 ━━━━━━━━━━━━━━━━━━━━ 1s 5ms/step - loss: 0.41\n"]
    out, _ = condensed([(w, "stdout", line) for w in (0, 1) for line in lines])
    assert out == "".join(f"[worker 0] {line}" for line in lines)


def test_a_consequence_traceback_becomes_one_line_and_a_root_cause_stays_whole():
    _, err = condensed([(0, "stderr", line) for line in CONSEQUENCE.splitlines(True)]
                       + [(1, "stderr", line) for line in ROOT_CAUSE.splitlines(True)])
    assert err.count("\n") == 1 + len(ROOT_CAUSE.splitlines())
    assert ("[worker 0] failed because a peer failed first (9-line traceback in its log): "
            "PeerLostError: worker:1 (127.0.0.1:46015) closed the connection") in err
    assert "".join(f"[worker 1] {line}" for line in ROOT_CAUSE.splitlines(True)) in err


def test_verbose_shows_every_line():
    writes = [(w, "stderr", line) for w in (0, 1) for line in NOISE_LINES]
    _, err = condensed(writes, verbose=True)
    assert err == "".join(f"[worker {w}] {line}" for w, _, line in writes)


def _train_and_kill(kill_at_step):
    from tf_distrib.demo import train

    return train(epochs=1, kill_at_step=kill_at_step)


@pytest.mark.multiprocess
def test_a_killed_worker_reads_as_one_story_and_the_logs_keep_everything(tmp_path, capfd):
    result = launch(_train_and_kill, 2, args=(20,), log_dir=str(tmp_path), timeout=300)
    out, err = capfd.readouterr()
    console = out + err
    assert result.exit_code == 128 + 9
    assert not [line for line in NOISE_LINES if line.split("]")[-1].strip() in console]
    assert "Traceback" not in console  # worker 1 died without one; worker 0's is folded
    assert re.search(r"\[worker 0\] failed because a peer failed first \(\d+-line traceback "
                     r"in its log\): .*PeerLostError: worker:1 ", console), console
    log = tmp_path / "attempt-0" / "worker-1.log"
    assert (f"[launcher] root cause: worker 1 (attempt 0, signal SIGKILL); its last 1 line(s), "
            f"all in {log}:\n[launcher]   | injected failure: SIGKILL at step 20") in console
    # The log files hold exactly what each worker printed; the console dropped only what
    # the rules above say.
    shown = {line.split("] ", 1)[1] for line in console.splitlines() if line.startswith("[w")}
    for worker in result.workers:
        logged = open(worker.log_path).read()
        assert logged == "".join(worker.output)
        assert os.path.dirname(worker.log_path) == str(tmp_path / "attempt-0")
        dropped = [line for line in logged.splitlines() if line not in shown]
        assert any(console_lib.NOISE.search(line) for line in dropped)
        assert all(console_lib.NOISE.search(line) or console_lib.PROGRESS.match(line)
                   or worker.index == 0 for line in dropped), dropped
    assert len(console.splitlines()) <= 8, console
