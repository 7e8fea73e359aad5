"""Seeing a job while it runs: `tf-distrib top`, the launch's timeline, per-worker scalars."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

# Two workers; worker 1's input pipeline sleeps 20 ms per batch of 64 (before the batch,
# so every global batch is provably full and TensorFlow runs no per-step data check).
SLOW_INPUT_JOB = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import tensorflow as tf
    import keras
    import tf_distrib as td

    slow = os.environ["TF_DISTRIB_WORKER_INDEX"] == "1"
    strategy = td.make_strategy()
    x = np.random.default_rng(0).standard_normal((64 * 400, 32)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")

    def sleepy(v):
        if slow:
            time.sleep(0.02 / 64)
        return v

    ds = tf.data.Dataset.from_tensor_slices((x, y)).map(
        lambda a, b: (tf.numpy_function(sleepy, [a], tf.float32, stateful=False), b))
    ds = ds.map(lambda a, b: (tf.ensure_shape(a, [32]), b)).batch(64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds, epochs=int(sys.argv[2]), verbose=0, callbacks=[
        td.callbacks.WorkerMetrics(sys.argv[1], update_freq=50)])
""")


def _top(*args):
    return subprocess.run([sys.executable, "-m", "tf_distrib.cli", "top", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_top_names_a_slow_input_pipeline_and_the_timeline_and_scalars_show_both(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SLOW_INPUT_JOB)
    log_dir, trace = tmp_path / "logs", tmp_path / "trace.json"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tf_distrib.launch", "-n", "2", "--log-dir", str(log_dir),
         "--timeline", str(trace), "--timeout", "240", str(script), str(tmp_path / "tb"), "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rows = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launcher.poll() is None:
            done = _top(str(log_dir), "--once", "--json")
            if done.returncode == 0:
                rows = [json.loads(line) for line in done.stdout.splitlines()]
                if len(rows) == 2 and all(r["step"] >= 150 for r in rows):
                    break
            time.sleep(1)
        assert rows and len(rows) == 2, (rows, done.stderr)
        frame = _top(str(log_dir), "--once")
        output = launcher.communicate(timeout=240)[0]
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    first, slow = rows
    assert set(first) >= {"worker", "phase", "step", "examples_per_sec", "step_time", "compute",
                          "input_wait", "exchange", "peer_wait", "cpu_percent", "rss_bytes",
                          "straggler"}
    assert (first["straggler"], slow["straggler"]) == (False, True), rows
    assert slow["input_wait"] > first["input_wait"] + 0.010, rows
    assert first["peer_wait"] > slow["peer_wait"] + 0.010, rows
    assert all(r["phase"] == "training" and r["rss_bytes"] > 0 for r in rows), rows
    assert "<- straggler" in frame.stdout and frame.returncode == 0

    finished = _top(str(log_dir), "--once")
    assert finished.returncode == 1 and "has finished" in finished.stderr

    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for worker in (0, 1):
        steps = {e["name"] for e in spans if e["pid"] == worker and e["cat"] == "steps"
                 and e["name"].startswith("step ")}
        collectives = [e for e in spans if e["pid"] == worker and e["cat"] == "collectives"]
        assert len(steps) == 200, (worker, len(steps))
        # One gradient bucket and the logged loss per step at least.
        assert len(collectives) >= 2 * 200 - 16, (worker, len(collectives))
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"worker 0", "worker 1"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for worker in (0, 1):
        run = EventAccumulator(str(tmp_path / "tb" / f"worker_{worker}"))
        run.Reload()
        tags = set(run.Tags()["tensors"])
        assert {"worker/step_time", "worker/input_wait", "worker/peer_wait",
                "worker/examples_per_sec"} <= tags, tags
        assert len(run.Tensors("worker/step_time")) >= 4


@pytest.mark.parametrize("make_dir, message", [
    (lambda d: d, "is not a tf-distrib launch's log directory"),
    (lambda d: d / "missing", "is not a tf-distrib launch's log directory"),
])
def test_top_on_a_directory_that_is_no_job_says_so_and_exits_1(tmp_path, make_dir, message):
    done = _top(str(make_dir(tmp_path)), "--once")
    assert done.returncode == 1
    assert message in done.stderr


def test_a_steps_split_adds_up_and_a_collective_inside_the_input_wait_is_not_input():
    from tf_distrib.health.steps import StepRecorder

    now = time.time()
    counters = iter([(0.0, 0.0, 0), (0.004, 0.003, 100)])
    collectives = [{"seq": 7, "bytes": 8, "started": now + 0.001, "ended": now + 0.002}]
    recorder = StepRecorder(0, counters=lambda: next(counters), collectives=lambda: collectives)
    recorder.add_span("backup", "backup", now - 0.010, now - 0.008, blocked=True)
    recorder.begin()
    time.sleep(0.02)
    step = recorder.end(input_wait=0.005, examples=32, input_span=(now, now + 0.005))
    close = lambda value: pytest.approx(value, abs=1e-6)  # noqa: E731 (epoch-sized floats)
    assert step.input_wait == close(0.004)  # the collective inside it left out
    assert (step.exchange, step.peer_wait, step.backup) == close((0.001, 0.003, 0.002))
    assert step.compute == close(step.ended - step.started - 0.008)
    assert step.duration == close(step.ended - step.started + 0.002)
    status = recorder.status()
    assert status["step"] == 1 and status["bytes_exchanged"] == 100
    assert status["examples_per_sec"] == pytest.approx(32 / (step.ended - step.started))


def test_a_merged_timeline_aligns_the_workers_clocks_on_their_collectives(tmp_path):
    from tf_distrib.health import timeline
    from tf_distrib.health.steps import StepRecorder

    parts = []
    start = time.time()
    for worker, skew in ((0, 0.0), (1, 5.0)):  # worker 1's clock runs 5 s ahead
        recorder = StepRecorder(worker)
        recorder.begin()
        recorder.end()
        recorder.steps[0].started = start
        for seq in range(3):
            recorder.add_span(f"all-reduce {seq}", "collectives", start + skew + seq,
                              start + skew + seq + 0.5, seq=seq, bytes=4)
        parts.append(timeline.part_path(str(tmp_path), worker))
        timeline.write_part(recorder, parts[-1])
    trace = timeline.merge(parts, str(tmp_path / "trace.json"))
    assert trace["otherData"]["clock_offsets_seconds"]["1"] == pytest.approx(-5.0, abs=1e-6)
    ends = {}
    for event in trace["traceEvents"]:
        if event.get("cat") == "collectives":
            ends.setdefault(event["args"]["seq"], []).append(event["ts"] + event["dur"])
    assert all(a == pytest.approx(b, abs=1) for a, b in ends.values())  # microseconds
    assert json.loads((tmp_path / "trace.json").read_text()) == trace
