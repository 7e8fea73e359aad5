"""The native op's build: once per machine, a failed build remembered with its cause."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from tf_distrib.transport import native_build

# A compiler that counts its runs in $COUNT, then fails as a compile error does.
FAILING_CXX = """#!/bin/sh
echo run >> "$COUNT"
echo "native_sum.cc:12:3: warning: something harmless" >&2
echo "native_sum.cc:40:7: error: 'Tensor' was not declared in this scope" >&2
exit 1
"""
# A compiler that counts its runs, takes a while, and writes its -o file.
SLOW_CXX = """#!/bin/sh
echo run >> "$COUNT"
sleep 1
while [ "$#" -gt 0 ]; do
  if [ "$1" = "-o" ]; then echo built > "$2"; fi
  shift
done
"""


# A build runs the compiler once per source (at once), then once to link.
COMPILES = len(native_build.SOURCES)


def _compiler(tmp_path, text):
    path = tmp_path / "cxx"
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def _env(tmp_path, cxx):
    return {**os.environ, "CXX": cxx, "COUNT": str(tmp_path / "count"),
            "TF_DISTRIB_CACHE_DIR": str(tmp_path / "cache"), "TF_CPP_MIN_LOG_LEVEL": "3"}


def _runs(tmp_path) -> int:
    count = tmp_path / "count"
    return len(count.read_text().splitlines()) if count.exists() else 0


@pytest.mark.multiprocess
def test_a_failed_build_is_remembered_named_and_rebuilt_on_request(tmp_path):
    env = _env(tmp_path, _compiler(tmp_path, FAILING_CXX))
    use = "from tf_distrib.transport import native_sum; print(native_sum.library())"
    warnings = []
    for _ in range(2):  # two processes, each using the op first
        done = subprocess.run([sys.executable, "-c", use], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "None"
        warnings.append(done.stderr)
    assert _runs(tmp_path) == COMPILES
    for warning in warnings:
        assert "the native ops are not used: it cannot be built" in warning
        assert "error: 'Tensor' was not declared in this scope" in warning
    assert "doctor --rebuild" in warnings[1]
    [failed] = [f for f in os.listdir(tmp_path / "cache") if f.endswith(".failed")]
    assert "was not declared" in (tmp_path / "cache" / failed).read_text()

    doctor = subprocess.run([sys.executable, "-m", "tf_distrib.doctor", "--rebuild",
                             "--no-probe"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert _runs(tmp_path) == 2 * COMPILES
    assert "native ops: unavailable" in doctor.stdout
    assert "Python path" in doctor.stdout


def test_eight_processes_using_it_first_at_once_build_it_once(tmp_path):
    env = _env(tmp_path, _compiler(tmp_path, SLOW_CXX))
    use = "from tf_distrib.transport import native_build; " \
          "print(native_build.library_path(['-DFLAG'], '2.21.0'))"
    processes = [subprocess.Popen([sys.executable, "-c", use], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(8)]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    [path] = paths
    assert path.startswith(str(tmp_path / "cache"))
    assert open(path).read() == "built\n"
    assert _runs(tmp_path) == COMPILES + 1


def test_the_cache_key_follows_the_compiler_and_the_cache_dir_follows_the_variable(
        tmp_path, monkeypatch):
    cxx = _compiler(tmp_path, SLOW_CXX)
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("COUNT", str(tmp_path / "count"))
    monkeypatch.setenv("TF_DISTRIB_CACHE_DIR", str(tmp_path / "one"))
    first = native_build.library_path([], "2.21.0")
    assert os.path.dirname(first) == str(tmp_path / "one")
    assert native_build.library_path([], "2.21.0") == first  # built: not built again
    assert _runs(tmp_path) == COMPILES + 1
    os.utime(cxx, ns=(0, 0))  # another compiler at the same path
    assert native_build.library_path([], "2.21.0") != first
    assert native_build.library_path([], "2.22.0") != first
    assert _runs(tmp_path) == 3 * (COMPILES + 1)
    header = tmp_path / "native_update.h"  # a header the sources include, changed
    header.write_bytes(pathlib.Path(native_build.HEADERS[0]).read_bytes() + b"\n")
    monkeypatch.setattr(native_build, "HEADERS", (str(header),))
    assert native_build.library_path([], "2.22.0") != first
    assert _runs(tmp_path) == 4 * (COMPILES + 1)


@pytest.mark.parametrize("setting, cause", [
    ({"CXX": "/nonexistent/c++"}, "no C++ compiler: /nonexistent/c++ is not on PATH"),
    ({"TF_DISTRIB_CACHE_DIR": "{tmp}/a-file/cache"}, "cannot write the cache directory"),
])
def test_a_build_that_cannot_start_names_its_cause(tmp_path, monkeypatch, setting, cause):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CXX", _compiler(tmp_path, SLOW_CXX))
    monkeypatch.setenv("COUNT", str(tmp_path / "count"))
    for name, value in setting.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    with pytest.raises(native_build.BuildFailed, match=re.escape(cause)):
        native_build.library_path([], "2.21.0")
    assert _runs(tmp_path) == 0


def test_a_library_that_does_not_load_is_named(tmp_path):
    env = _env(tmp_path, _compiler(tmp_path, SLOW_CXX))  # "builds" a file that is no library
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from tf_distrib.transport import native_sum
        print(native_sum.library())
    """)], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "None", done.stderr
    assert "did not load" in done.stderr
    assert "doctor --rebuild" in done.stderr
