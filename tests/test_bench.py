"""The benchmark runner's plumbing and the cluster cost model (benchmarks run with `make bench`)."""

import pytest

from tf_distrib.bench import run_in_fresh_process


def test_a_failed_benchmark_process_says_why():
    with pytest.raises(RuntimeError, match=r"(?s)tf_distrib\.no_such_bench failed with exit "
                                           r"status 1:.*No module named"):
        run_in_fresh_process("tf_distrib.no_such_bench")


def test_scaling_and_overhead_pair_each_row_with_its_baseline_of_the_same_round():
    from tf_distrib.bench.scaling import _rounds

    def measurements(rates, cpu_ms, collectives_ms=(None,) * 3):
        rows = iter([{"examples_per_sec": r, "cpu_per_step": c / 1e3,
                      "in_collectives_per_step": k and k / 1e3}
                     for r, c, k in zip(rates, cpu_ms, collectives_ms, strict=True)])
        return lambda: next(rows)

    # The machine's speed moves between rounds; each round's pair moves with it.
    runs = {"1 worker": ("1 worker", measurements([100, 200, 150], [30, 40, 35])),
            "2 workers": ("1 worker", measurements([190, 360, 240], [32, 43, 41], [1, 3, 2]))}
    report = _rounds(runs, rounds=3)
    assert report["scaling_per_round"]["2 workers"] == pytest.approx([1.9, 1.8, 1.6])
    assert report["scaling"]["2 workers"] == pytest.approx(1.8)  # not 240 / 150
    assert report["overhead_ms_per_round"]["2 workers"] == pytest.approx([2, 3, 6])
    assert report["overhead_ms_per_step"]["2 workers"] == pytest.approx(3)  # not 41 - 35
    assert report["overhead_ms_per_step"]["1 worker"] == 0
    assert report["in_collectives_ms_per_step"] == {"2 workers": pytest.approx(2)}


def test_a_row_is_also_read_against_another_one_worker_row_of_the_same_round():
    from tf_distrib.bench.scaling import _rounds, _scaling_against

    def rates(values):
        rows = iter([{"examples_per_sec": r, "cpu_per_step": 0.01} for r in values])
        return lambda: next(rows)

    runs = {"1 worker": ("1 worker", rates([150, 300, 200])),
            "1 worker, plain dataset": ("1 worker, plain dataset", rates([100, 200, 150])),
            "2 workers, plain": ("1 worker, plain dataset", rates([240, 450, 330]))}
    report = _rounds(runs, rounds=3)
    assert report["scaling"]["2 workers, plain"] == pytest.approx(2.25)
    assert _scaling_against(report, "2 workers, plain", "1 worker") == pytest.approx(1.6)


def test_in_turns_each_pair_epoch_meets_the_one_worker_epochs_around_it():
    from tf_distrib.bench.scaling import compare_turns

    alone = {"examples_per_sec": [0, 100, 300, 200], "cpu_per_step": [0, 0.030, 0.050, 0.040],
             "in_collectives_per_step": [None] * 4}
    pair = [{"examples_per_sec": [0, 360, 500], "cpu_per_step": [0, c, c + 0.002],
             "in_collectives_per_step": [0, c / 10, c / 20]} for c in (0.042, 0.044)]
    turns = compare_turns([*pair, alone], pairs=2, apart=False)
    assert turns["scaling"] == pytest.approx([360 / 200, 500 / 250])
    assert turns["examples_per_sec"] == [360, 500]
    assert turns["one_worker_examples_per_sec"] == pytest.approx([200, 250])
    assert turns["overhead_ms_per_step"] == pytest.approx([43 - 40, 45 - 45])
    assert turns["in_collectives_ms_per_step"] == pytest.approx([4.3, 2.15])
    for worker in pair:
        worker["in_collectives_per_step"] = [None] * 3
    ceiling = compare_turns([*pair, alone], pairs=2, apart=True)  # both rates add
    assert ceiling["scaling"] == pytest.approx([720 / 200, 1000 / 250])
    assert ceiling["in_collectives_ms_per_step"] is None


def test_a_turn_that_never_comes_times_out_naming_what_is_missing(tmp_path):
    from tf_distrib.bench.scaling import Turns, _wait_for_turn

    turns = Turns(str(tmp_path), pairs=2)
    _wait_for_turn(turns, index=2, epoch=0)  # the one worker alone starts
    (tmp_path / "0-0").touch()
    with pytest.raises(TimeoutError, match=r"worker 2 .* epoch 1: no end of \['0-0', '1-0'\]"):
        _wait_for_turn(turns, index=2, epoch=1, timeout=0.05)
    (tmp_path / "1-0").touch()
    _wait_for_turn(turns, index=2, epoch=1, timeout=0.05)


def _rows(model):
    """Rows as `bench cluster` measures them, timed by `model` itself."""
    from tf_distrib.bench import cluster

    rows = [{"rate": rate, "hosts": 2, "per_host": per_host, "mode": mode, "dtype": dtype,
             "bytes": nbytes}
            for rate in ("1gbit", "10gbit") for per_host, mode in ((1, "tcp"), (2, "shm+tcp"))
            for dtype in ("float32", "bfloat16") for nbytes in (1 << 20, 7 << 20)]
    for row in rows:
        row["seconds"] = cluster.predict(model, row, cores=2)
    return rows


def test_the_cost_model_recovers_the_constants_it_was_measured_with():
    from tf_distrib.bench import cluster

    truth = {"a": cluster.ROUND_SECONDS, "e": 0.95, "c": 1e-9, "d": 2e-9, "w": 1e-9,
             "s": 1e-9}
    model = cluster.calibrate(_rows(truth), cores=2)
    # Three hosts, never calibrated on: predicted as the true constants predict it.
    row = {"rate": "10gbit", "hosts": 3, "per_host": 1, "mode": "tcp", "dtype": "float32",
           "bytes": 7 << 20}
    assert cluster.predict(model, row, cores=2) == pytest.approx(
        cluster.predict(truth, row, cores=2), rel=0.02)


def test_the_cost_model_says_when_it_has_no_fit():
    from tf_distrib.bench import cluster

    rows = _rows({"a": cluster.ROUND_SECONDS, "e": 1.0, "c": 0.0, "d": 0.0, "w": 0.0,
                  "s": 0.0})
    for row in rows:
        row["seconds"] *= 0.5  # faster than the link alone: only negative constants fit
    with pytest.raises(ValueError, match="no fit with non-negative constants"):
        cluster.calibrate(rows, cores=2)


def test_a_cluster_run_whose_rows_fit_no_model_goes_on_without_predictions(capsys):
    from tf_distrib.bench import cluster

    truth = {"a": cluster.ROUND_SECONDS, "e": 0.95, "c": 1e-9, "d": 2e-9, "w": 1e-9,
             "s": 1e-9}
    rows = _rows(truth)
    assert cluster._model(rows, cores=2) is not None
    assert all("predicted_seconds" in row for row in rows)

    rows = _rows({"a": cluster.ROUND_SECONDS, "e": 1.0, "c": 0.0, "d": 0.0, "w": 0.0,
                  "s": 0.0})
    for row in rows:
        row["seconds"] *= 0.5
    assert cluster._model(rows, cores=2) is None
    assert "cost model: not fitted" in capsys.readouterr().out
    assert not any("predicted_seconds" in row for row in rows)


def test_a_benchmark_s_temporary_files_are_removed_after_it(tmp_path, monkeypatch):
    import json
    import os
    import tempfile

    from tf_distrib import bench

    monkeypatch.setitem(bench.BENCHMARKS, "probe", "tests._bench_probe")
    before = os.environ.get("TMPDIR"), tempfile.gettempdir()
    assert bench.main(["probe", "--out", str(tmp_path)]) == 0
    made = json.loads((tmp_path / "probe.json").read_text())
    # Temporary files (launches' log directories) went to a scratch directory, this
    # process's and its children's alike, and that is gone.
    for path in (made["mine"], made["child"]):
        assert os.path.dirname(path) == made["TMPDIR"] != before[1]
        assert not os.path.exists(path)
    assert (os.environ.get("TMPDIR"), tempfile.gettempdir()) == before


def _measure_then_exit(abort: str, directory: str):
    """A benchmark process that returns its measurement, aborting after (`abort` "after")
    or before it returns (`abort` "before") when it is worker 1. After: at exit, once
    worker 0 has exited (its pid in `directory`), as a gloo process that its peers
    finished with."""
    import atexit
    import os
    import resource
    import time

    pid_file = os.path.join(directory, "worker-0.pid")
    if os.environ["TF_DISTRIB_WORKER_INDEX"] == "0":
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        return {"examples_per_sec": 100.0, "cpu_per_step": 0.01}
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file where tests run
    if abort == "before":
        os.abort()

    def abort_once_worker_0_exited():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _exited(pid_file):
            time.sleep(0.01)
        os.abort()

    atexit.register(abort_once_worker_0_exited)
    return {"examples_per_sec": 100.0, "cpu_per_step": 0.01}


def _exited(pid_file: str) -> bool:
    """Whether the process whose pid `pid_file` holds has exited (a zombie counts)."""
    try:
        with open(pid_file) as f, open(f"/proc/{f.read()}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError as e:
        return e.filename != pid_file  # no pid file yet: not yet; no /proc entry: exited


def test_a_peer_run_whose_process_aborts_after_measuring_keeps_its_measurement(tmp_path):
    from tf_distrib.bench.pytorch_ddp import measured
    from tf_distrib.launch import launch

    after = launch(_measure_then_exit, 2, args=("after", str(tmp_path)), quiet=True,
                   timeout=120)
    assert after.exit_code != 0  # worker 1 died of SIGABRT at exit
    assert measured(after) == [{"examples_per_sec": 100.0, "cpu_per_step": 0.01}] * 2
    before = launch(_measure_then_exit, 2, args=("before", str(tmp_path)), quiet=True,
                    timeout=120)
    assert before.exit_code != 0
    assert measured(before) is None
