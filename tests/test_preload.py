"""Launches preload by default, and start fresh processes, saying why, where a target sets
TensorFlow's environment before importing it."""

import os
import subprocess
import sys
import textwrap

import pytest

from tf_distrib.launch.preload import reason_not_to


@pytest.mark.parametrize("code, reason", [
    ("import os\nos.environ['TF_ENABLE_ONEDNN_OPTS'] = '0'\nimport tensorflow as tf\n",
     "sets TF_ENABLE_ONEDNN_OPTS at line 2 before it imports TensorFlow"),
    ("import os\nos.environ.setdefault('KERAS_BACKEND', 'tensorflow')\nimport keras\n",
     "sets KERAS_BACKEND at line 2"),
    ("import os\nos.putenv('OMP_NUM_THREADS', '1')\nimport tf_distrib as td\n",
     "sets OMP_NUM_THREADS at line 2"),  # TensorFlow loads later, inside tf_distrib
    ("import os\nname = 'TF_CPP_MIN_LOG_LEVEL'\nos.environ[name] = '3'\n"
     "from tensorflow import keras\n", "sets an environment variable named at run time at line 3"),
    ("import os\nos.environ.update(A='1')\nimport tensorflow\n", "os.environ.update"),
    ("import tensorflow as tf\nimport os\nos.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n", None),
    ("import os\nos.environ['MY_APP_SETTING'] = '1'\nimport tensorflow as tf\n", None),
    ("import os\nos.environ['TF_CONFIG'] = '{}'\nimport tensorflow as tf\n", None),
    ("import tf_distrib as td\nstrategy = td.make_strategy()\n", None),
])
def test_a_script_that_sets_tensorflows_environment_first_is_named(tmp_path, code, reason):
    script = tmp_path / "train.py"
    script.write_text(code)
    found = reason_not_to(str(script))
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found and str(script) in found


def train_setting_threads_first():
    os.environ["OMP_NUM_THREADS"] = "1"
    import tensorflow  # noqa: F401


def train():
    import tensorflow  # noqa: F401

    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"


def test_functions_and_modules_are_read_too(tmp_path, monkeypatch):
    assert "train_setting_threads_first() sets OMP_NUM_THREADS" in reason_not_to(
        train_setting_threads_first)
    assert reason_not_to(train) is None
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "job.py").write_text("import os\nos.environ['TF_X'] = '1'\n")
    monkeypatch.chdir(tmp_path)
    assert "module mypkg.job sets TF_X at line 2" in reason_not_to("-m mypkg.job")
    assert "cannot be read" in reason_not_to(["-m", "no_such_module_anywhere"])


# Prints whether this worker was forked by the preload server (its parent) or started
# by the launcher itself.
WHO_STARTED_ME = textwrap.dedent("""
    import os{setting}
    import tensorflow
    parent = open(f"/proc/{{os.getppid()}}/cmdline").read()
    print("forked" if "forkserver" in parent else "fresh")
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting, started", [
    ("", "forked"),
    ("\nos.environ['TF_ENABLE_ONEDNN_OPTS'] = '0'", "fresh"),
])
def test_the_default_launch_preloads_unless_the_script_sets_tensorflows_environment(
        tmp_path, setting, started):
    script = tmp_path / "job.py"
    script.write_text(WHO_STARTED_ME.format(setting=setting))
    env = {k: v for k, v in os.environ.items() if k != "TF_DISTRIB_PRELOAD"}
    done = subprocess.run([sys.executable, "-m", "tf_distrib.launch", "-n", "2",
                           "--startup-timeout", "0", str(script)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    # Both: shown once when they print within the console's window (0.25 s), which two
    # fresh interpreters on 2 loaded cores may miss.
    assert f"[workers 0-1] {started}" in done.stdout or all(
        f"[worker {i}] {started}" in done.stdout for i in range(2)), done.stdout
    named = "workers start as fresh processes: " in done.stderr
    assert named == (started == "fresh"), done.stderr
    if started == "fresh":
        assert "sets TF_ENABLE_ONEDNN_OPTS at line 3" in done.stderr
