"""The launcher with real processes: restarts, timeouts, signals, job files, two hosts."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests._leftovers import alive
from tf_distrib.cluster import free_ports
from tf_distrib.launch import LaunchError, forkserver, launch

pytestmark = pytest.mark.multiprocess

LAUNCH = [sys.executable, "-m", "tf_distrib.launch"]
# The command-line tests start a fresh interpreter per worker, which the rest of the suite
# skips for speed (tests/conftest.py); tests/test_preload.py checks the default's choice.
CLI_ENV = {**os.environ, forkserver.ENV_PRELOAD: "0"}

CRASH_ON_FIRST_ATTEMPT = """
import os, sys
index = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
attempt = int(os.environ["TF_DISTRIB_ATTEMPT"])
print(f"worker {index} attempt {attempt} of", os.environ["TF_DISTRIB_NUM_WORKERS"],
      "args", sys.argv[1:])
if index == 1 and attempt == 0:
    print("worker 1 gives up", file=sys.stderr)
    sys.exit(3)
"""

# Like an MWMS worker: ignores SIGTERM; also starts a grandchild that must not survive.
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "1000"])
with open(os.path.join(sys.argv[1], f"pids-{os.environ['TF_DISTRIB_WORKER_INDEX']}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
print("ready", flush=True)
time.sleep(1000)
"""


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def run_cli(*args, timeout=120):
    return subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=timeout,
                          env=CLI_ENV)


def test_restart_after_a_crash_then_success(tmp_path):
    script = write(tmp_path, "crash.py", CRASH_ON_FIRST_ATTEMPT)
    summary = tmp_path / "summary.json"
    done = run_cli("-n", "2", "--max-restarts", "1", "--startup-timeout", "0",
                   "--summary-file", str(summary), script, "--lr", "0.1")
    assert done.returncode == 0, done.stderr
    assert "[worker 1] worker 1 attempt 1 of 2 args ['--lr', '0.1']" in done.stdout
    assert "[worker 1] worker 1 gives up" in done.stderr
    report = json.loads(summary.read_text())
    assert report["restarts"] == 1
    assert [a["exit_codes"] for a in report["attempts"]] == [[0, 3], [0, 0]]


def test_no_restarts_left_names_the_worker_and_its_status(tmp_path):
    script = write(tmp_path, "crash.py", CRASH_ON_FIRST_ATTEMPT)
    done = run_cli("-n", "2", "--startup-timeout", "0", script)
    assert done.returncode == 3
    assert "worker 1 failed with exit status 3" in done.stderr
    assert "worker 1 gives up" in done.stderr.split("last")[-1]


@pytest.mark.parametrize("preload", [False, True], ids=["fresh", "preloaded"])
def test_function_target_with_result_values_and_exit_codes(preload):
    def crash_once(base):
        import os
        attempt = int(os.environ["TF_DISTRIB_ATTEMPT"])
        if attempt == 0 and os.environ["TF_DISTRIB_WORKER_INDEX"] == "0":
            os.kill(os.getpid(), 9)
        return base + int(os.environ["TF_DISTRIB_WORKER_INDEX"])

    result = launch(crash_once, 2, args=(10,), max_restarts=2, startup_timeout=None,
                    quiet=True, preload=preload)
    assert result.exit_code == 0 and result.restarts == 1
    assert result.values == [10, 11]
    assert result.exit_codes[0][0] == -signal.SIGKILL
    assert result.attempts[0].failure == "worker 0 failed with signal SIGKILL"


@pytest.mark.parametrize("preload", [False, True], ids=["fresh", "preloaded"])
def test_worker_that_never_starts_tensorflow_fails_within_startup_timeout(tmp_path, preload):
    script = write(tmp_path, "stubborn.py", STUBBORN)
    if preload:  # a started fork server, so that the time below is the workers' alone
        launch(int, 1, startup_timeout=None, quiet=True, preload=True)
    start = time.monotonic()
    result = launch(script, 2, args=(str(tmp_path),), startup_timeout=3, grace_period=1,
                    quiet=True, preload=preload)
    elapsed = time.monotonic() - start
    assert result.exit_code != 0
    assert "did not reach its first training step within startup_timeout=3 s (TensorFlow's " \
        "server on 127.0.0.1:" in result.attempts[0].failure
    assert elapsed < 3 + 1 + 5
    pids = [int(p) for i in range(2) for p in (tmp_path / f"pids-{i}").read_text().split()]
    assert [w.pid for w in result.workers] == pids[::2]
    assert not [pid for pid in pids if alive(pid)]


def test_sigint_to_the_launcher_stops_every_worker(tmp_path):
    script = write(tmp_path, "stubborn.py", STUBBORN)
    launcher = subprocess.Popen([*LAUNCH, "-n", "2", "--startup-timeout", "0",
                                 "--grace-period", "1", script, str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=CLI_ENV)
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("pids-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    pids = [int(p) for f in tmp_path.glob("pids-*") for p in f.read_text().split()]
    assert len(pids) == 4
    launcher.send_signal(signal.SIGINT)
    launcher.communicate(timeout=1 + 5)
    assert launcher.returncode == 128 + signal.SIGINT
    assert not [pid for pid in pids if alive(pid)]


def test_function_defined_in_main_like_a_notebook_cell():
    code = textwrap.dedent("""
        from tf_distrib.launch import launch

        def square(x):  # lives in __main__, as a notebook cell's function does
            import os
            return x * x + int(os.environ["TF_DISTRIB_WORKER_INDEX"])

        print(launch(square, 2, args=(7,), startup_timeout=None, quiet=True).values)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=CLI_ENV)
    assert done.stdout.strip() == "[49, 50]", done.stderr


@pytest.mark.parametrize("flags, preloaded", [([], False), (["--preload"], True)],
                         ids=["default", "--preload"])
def test_the_command_line_preloads_only_when_asked(tmp_path, flags, preloaded):
    script = write(tmp_path, "probe.py", """
        import sys
        print("tensorflow imported before the script:", "tensorflow" in sys.modules)
    """)
    done = run_cli("-n", "1", "--startup-timeout", "0", *flags, script)
    assert done.returncode == 0, done.stderr
    assert f"[worker 0] tensorflow imported before the script: {preloaded}" in done.stdout


def _describe_worker(tag):
    import gc
    import os
    import sys
    return {"preloaded": "tensorflow" in sys.modules, "frozen": gc.get_freeze_count(),
            "pid": os.getpid(),
            "server": os.getppid(), "session": os.getsid(0), "group": os.getpgrp(),
            "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
            "index": int(os.environ["TF_DISTRIB_WORKER_INDEX"]), "cwd": os.getcwd(),
            "tag": os.environ["TAG"], "argv0": sys.argv[0], "arg": tag,
            "main": sys.modules["__main__"].__name__}


def test_preloaded_workers_are_processes_of_their_own_forked_from_one_server(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs, fds = [], []
    for tag in ("first", "second"):
        runs.append(launch(_describe_worker, 2, args=(tag,), env={"TAG": "same"}, quiet=True,
                           startup_timeout=None, preload=True))
        fds.append(len(os.listdir("/proc/self/fd")))
    assert fds[0] == fds[1]  # nothing of a worker's left open here
    values = [v for run in runs for v in run.values]
    assert [v["arg"] for v in values] == ["first", "first", "second", "second"]
    assert [(v["index"], v["task"]) for v in values] == [(0, 0), (1, 1)] * 2
    assert [v["pid"] for v in values] == [w.pid for run in runs for w in run.workers]
    assert all(v["preloaded"] and v["session"] == v["group"] == v["pid"] for v in values)
    # What the server imported is frozen out of the collector's walks (~350,000 objects).
    assert all(v["frozen"] > 100_000 for v in values), [v["frozen"] for v in values]
    assert all(v["cwd"] == str(tmp_path) and v["tag"] == "same" for v in values)
    assert all(v["main"] == "__main__" and v["argv0"].endswith("run_function.py")
               for v in values)
    [server] = {v["server"] for v in values}  # one server, reused by the second launch
    assert server not in (os.getpid(), *(v["pid"] for v in values))
    other = launch(_describe_worker, 1, args=("other",), env={"TAG": "other"}, quiet=True,
                   startup_timeout=None, preload=True).values[0]
    assert other["server"] != server and other["tag"] == "other"
    forkserver.close_all()
    assert not alive(server) and not alive(other["server"])


def _sleep_after_naming_the_server(directory):
    import os
    import time
    with open(os.path.join(directory, "server"), "w") as f:
        f.write(str(os.getppid()))
    time.sleep(1000)


def test_a_killed_fork_server_hangs_nothing_and_is_replaced(tmp_path):
    def kill_the_server():
        deadline = time.monotonic() + 60
        while not (tmp_path / "server").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.1)
        os.kill(int((tmp_path / "server").read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_the_server)
    killer.start()
    start = time.monotonic()
    result = launch(_sleep_after_naming_the_server, 1, args=(str(tmp_path),), timeout=15,
                    grace_period=1, startup_timeout=None, quiet=True, preload=True)
    killer.join()
    # Its exit status died with the server; the launch still ends on time, the worker
    # stopped, and the next launch starts a new server.
    assert result.exit_codes == [[-signal.SIGKILL]]
    assert time.monotonic() - start < 15 + 1 + 5
    assert not alive(result.workers[0].pid)
    assert launch(int, 1, startup_timeout=None, quiet=True, preload=True).exit_code == 0


def test_preload_that_cannot_import_tensorflow_names_the_error(tmp_path):
    (tmp_path / "tensorflow.py").write_text("raise ImportError('no TensorFlow in here')\n")
    with pytest.raises(LaunchError, match=r"(?s)fork server exited \(exit status 1\).*"
                                          r"no TensorFlow in here"):
        launch(_describe_worker, 1, args=("x",), env={"PYTHONPATH": str(tmp_path)},
               quiet=True, startup_timeout=None, preload=True)


def test_job_file_with_restarts(tmp_path):
    write(tmp_path, "crash.py", CRASH_ON_FIRST_ATTEMPT)
    job = write(tmp_path, "job.yaml", """
        script: crash.py
        args: [--epochs, 2]
        num_workers: 2
        max_restarts: 1
        startup_timeout: null
        env: {EXTRA: "1"}
    """)
    done = run_cli("--config", job)
    assert done.returncode == 0, done.stderr
    assert "args ['--epochs', '2']" in done.stdout


MARKER_SCRIPT = "open(__file__ + '.ran', 'w').close()\n"


@pytest.mark.parametrize("make_args, message", [
    (lambda d, s: ["-n", "2", str(d / "missing.py")], "does not exist"),
    (lambda d, s: ["-n", "0", s], "num_workers must be an integer >= 1"),
    (lambda d, s: ["--max-restarts", "-1", s], "max_restarts must be"),
    (lambda d, s: ["--config", str(d / "nope.yaml")], "Cannot read job file"),
    (lambda d, s: ["--config", write(d, "bad.yaml", "script: [unclosed")], "not valid YAML"),
    (lambda d, s: ["--config", write(d, "job.json", '{"script": "x.py", "workers": 2}')],
     "unknown key(s) ['workers']"),
    (lambda d, s: ["--config", write(d, "job.yaml", "script: x.py\nnum_workers: two")],
     "'num_workers' has the wrong type"),
    (lambda d, s: [], "Give exactly one of a script or a module"),
    (lambda d, s: ["--hosts", "a,b", "--host-index", "2", s], "host_index must be in 0..1"),
    (lambda d, s: ["-n", "3:2", s], "needs 1 <= MIN <= MAX, got '3:2'"),
    (lambda d, s: ["-n", "0:2", s], "needs 1 <= MIN <= MAX, got '0:2'"),
    (lambda d, s: ["-n", "a:b", s], "must be N or MIN:MAX (e.g. 2 or 1:4), got 'a:b'"),
    (lambda d, s: ["--hosts", "a,b", "--min-hosts", "3", s], "min_hosts (3) is more than"),
])
def test_bad_input_exits_2_and_starts_nothing(tmp_path, make_args, message):
    script = write(tmp_path, "marker.py", MARKER_SCRIPT)
    done = run_cli(*make_args(tmp_path, script))
    assert done.returncode == 2
    assert message in done.stderr
    assert not os.path.exists(script + ".ran")


TRAIN_SCRIPT = """
from tf_distrib.demo import train

summary = train(epochs=1)
print("result", summary["task"], summary["workers"], summary["loss"])
"""


def test_two_host_static_launch_trains_mwms(tmp_path):
    script = write(tmp_path, "train.py", TRAIN_SCRIPT)
    a, b = free_ports(2)
    hosts = f"127.0.0.1:{a},127.0.0.1:{b}"
    procs = [subprocess.Popen([*LAUNCH, "-n", "1", "--hosts", hosts, "--host-index", str(i),
                               "--timeout", "180", script],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=200) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = [line.split("result ")[1] for out, _ in outputs for line in out.splitlines()
               if "result " in line]
    assert results[0].startswith("worker:0 2 [") and results[1].startswith("worker:1 2 [")
    assert results[0].split(" ", 2)[2] == results[1].split(" ", 2)[2]
    assert "[worker 1] result worker:1" in outputs[1][0]
