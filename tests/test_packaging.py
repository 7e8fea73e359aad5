"""What pip installs: ranges, not pins, and no second TensorFlow next to the user's; what
`make system-deps` does where it cannot install."""

import importlib.metadata
import json
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def test_requirements_are_ranges_on_tensorflow_not_tensorflow_cpu():
    requires = importlib.metadata.requires("tf_distrib")
    core = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("tensorflow<") or r.startswith("tensorflow>") for r in core), core
    assert not [r for r in requires if r.startswith("tensorflow-cpu")]
    assert not [r for r in core if "==" in r], core  # a library pins nothing


def test_one_tensorflow_is_installed():
    importlib.metadata.distribution("tensorflow")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("tensorflow-cpu")


@pytest.mark.multiprocess
def test_installing_next_to_tensorflow_adds_nothing_but_tf_distrib(tmp_path):
    # Offline (--no-index): the resolver may only use what is installed. If tf_distrib
    # asked for anything this environment's TensorFlow does not satisfy (tensorflow-cpu,
    # a pinned version), there would be nothing to install it from, and pip would fail.
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                           "--no-build-isolation", "--quiet", "--report", str(report),
                           str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # Setuptools versions spell the name tf_distrib or tf-distrib; PEP 503 makes them one.
    installed = [re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
                 for item in json.loads(report.read_text())["install"]]
    assert installed == ["tf-distrib"]


@pytest.mark.multiprocess
def test_the_wheel_ships_the_native_ops_source(tmp_path):
    # Built on first use against the user's TensorFlow (tf_distrib/transport/native_sum.py).
    # From a copy: setuptools builds in the source tree.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "site", "*.egg-info", "__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                           "--no-build-isolation", "--quiet", "-w", str(tmp_path), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [wheel] = tmp_path.glob("tf_distrib-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert {"tf_distrib/transport/native_sum.cc", "tf_distrib/transport/native_update.h",
                "tf_distrib/cross_device/powersgd_ops.cc"} <= set(z.namelist())


def test_constraints_pin_what_ci_runs():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert "tensorflow" in pins and "tensorflow-cpu" not in pins
    assert pins["keras"].startswith("3.")


def test_system_deps_without_the_tools_or_a_way_to_install_them_says_so_and_succeeds():
    # No PATH: no Slurm, no strace, no `id` and no apt-get. CI's `make test` runs after
    # `make system-deps`, so this must print why the tests will skip and exit 0.
    done = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "system-deps"],
                          env={"PATH": "/nonexistent"}, capture_output=True, text=True,
                          timeout=60, executable=shutil.which("make"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the Slurm and strace tests will skip" in done.stdout
