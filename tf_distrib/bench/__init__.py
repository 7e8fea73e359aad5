"""`make bench` / `tf-distrib bench`: tf_distrib next to TensorFlow's built-ins, with ratios.

Each benchmark runs tf_distrib and the built-in it competes with in the same run,
prints a table and writes JSON under `--out` (default bench-results/).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

from tf_distrib._scratch import scratch_tempdir

# Benchmark name -> module with run(options) -> dict (its printed table is its own).
BENCHMARKS = {
    "strategies": "tf_distrib.bench.strategies",
    "backup": "tf_distrib.bench.backup",
    "data": "tf_distrib.bench.data",
    "allreduce": "tf_distrib.bench.allreduce",
    "mwms": "tf_distrib.bench.mwms",
    "fit_ops": "tf_distrib.bench.fit_ops",
    "scaling": "tf_distrib.bench.scaling",
    "cluster": "tf_distrib.bench.cluster",
    "model_parallel": "tf_distrib.bench.model_parallel",
    "startup": "tf_distrib.bench.startup",
    "monitoring": "tf_distrib.bench.monitoring",
    "recovery": "tf_distrib.bench.recovery",
    "convergence": "tf_distrib.bench.convergence",
    "gpu": "tf_distrib.bench.gpu",
}


def cpu_seconds() -> float:
    """CPU seconds this process has used so far, every thread, user and system."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_in_fresh_process(module: str, *args) -> object:
    """Runs `python -m module args...` and returns what its last line of output holds (JSON).

    Benchmarks that set logical devices need a process of their own: TensorFlow fixes
    its devices once it starts. TensorFlow's C++ logging is quietened there.

    Raises:
        RuntimeError: the process failed; the message ends with its last output lines.
    """
    result = subprocess.run([sys.executable, "-m", module, *map(str, args)],
                            capture_output=True, text=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if result.returncode:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"{module} failed with exit status {result.returncode}:\n{tail}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """`tf-distrib bench [NAMES]`: run benchmarks, print tables, write JSON."""
    parser = argparse.ArgumentParser(prog="tf-distrib bench", description=__doc__)
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], default=[],
                        help="benchmarks to run (default: all)")
    parser.add_argument("--out", default="bench-results", help="directory for JSON results")
    parser.add_argument("--quick", action="store_true", help="fewer steps, for smoke tests")
    options = parser.parse_args(argv)
    os.makedirs(options.out, exist_ok=True)
    # A launch keeps its workers' logs in the temporary directory after the job (for the
    # user to read); a benchmark's hundreds of launches would leave hundreds. Theirs go
    # to a scratch directory, this process's and its children's, removed at the end.
    with scratch_tempdir("tf_distrib_bench_", children=True):
        for name in options.names or BENCHMARKS:
            _run(name, options)
    return 0


def _run(name: str, options: argparse.Namespace) -> None:
    print(f"\n== {name} ==", flush=True)
    result = importlib.import_module(BENCHMARKS[name]).run(options)
    path = os.path.join(options.out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"(written to {path})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
