"""What watching a job costs: the scaling MLP's 2 workers with monitoring off and on.

Three settings of the same job (`tf_distrib.bench.scaling.train_worker`: 2 workers pinned
to a core each, the MLP through `distribute_dataset`), alternating in `ROUNDS` rounds:
no step recording at all; the launcher's status files with a `Timeline` and a
`WorkerMetrics` callback on every worker; and the same with `tf-distrib top` attached,
refreshing once a second. Each setting's rate is divided by the "off" rate of its
own round; the figure is the median over rounds.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading

from tf_distrib.launch import top

ROUNDS = 5
SETTINGS = ("off", "timeline + metrics", "timeline + metrics, top attached")


def _job(monitoring: bool, workdir: str) -> list:
    from tf_distrib.bench import scaling
    from tf_distrib.launch import launch

    result = launch(scaling.train_worker, 2, args=({},), kwargs={
        "monitoring_dir": workdir if monitoring else None}, quiet=True, timeout=900,
        log_dir=f"{workdir}/logs")
    if result.exit_code:
        raise RuntimeError(result.failure_report())
    return result.values


def _measure(setting: str, workdir: str) -> float:
    watchers: list[subprocess.Popen] = []
    done = threading.Event()

    def attach_top():  # as a user would: one live `top`, once the job is there
        launch_file = os.path.join(workdir, "logs", top.LAUNCH_FILE)
        while not done.wait(0.05):
            if os.path.exists(launch_file):
                watchers.append(subprocess.Popen(
                    [sys.executable, "-m", "tf_distrib.cli", "top", f"{workdir}/logs"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                return

    attacher = threading.Thread(target=attach_top) if "top" in setting else None
    if attacher is not None:
        attacher.start()
    try:
        return _job(setting != "off", workdir)[0]["examples_per_sec"]
    finally:
        done.set()
        if attacher is not None:
            attacher.join()
        for watcher in watchers:
            watcher.kill()
            watcher.wait()


def run(options) -> dict:
    import tempfile

    rounds = 1 if options.quick else ROUNDS
    rates = {s: [] for s in SETTINGS}
    for _ in range(rounds):
        for setting in SETTINGS:
            with tempfile.TemporaryDirectory(prefix="tf_distrib_bench_monitoring_") as d:
                rates[setting].append(_measure(setting, d))
    ratios = {s: [r / off for r, off in zip(rates[s], rates["off"], strict=True)]
              for s in SETTINGS}
    report = {"examples_per_sec": {s: statistics.median(r) for s, r in rates.items()},
              "against_off": {s: statistics.median(r) for s, r in ratios.items()},
              "against_off_per_round": ratios, "rounds": rounds}
    print(f"{'2 workers x 1 core, MLP':<36} {'examples/s':>11} {'vs off':>7}  rounds")
    for s in SETTINGS:
        print(f"{s:<36} {report['examples_per_sec'][s]:>11,.0f} "
              f"{report['against_off'][s]:>6.3f}x  "
              + ", ".join(f"{r:.3f}" for r in ratios[s]))
    return report
