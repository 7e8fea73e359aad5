"""Scaling: 2 MWMS workers pinned to one core each against 1 worker on one core.

Each worker is pinned to its own core with one intra-op thread and trains one of
`MODELS` (the MLP 784-1024-1024-10, 128 examples per worker per step; a small CNN on
32x32x3 images), its data through `distribute_dataset` or as a plain batched dataset.
The ratio of global examples/s (2 workers / 1 worker) is the scaling (2.0 is perfect).
Rows: TensorFlow's collective, tf_distrib's transport (shm, tcp), K=4 accumulation,
two workers that never communicate (the ceiling), PyTorch DDP (gloo) when installed.
Each row also prints the CPU a second worker adds per step and the time inside the
collectives; `all_reduce_floor` is the copy and sum no shared-memory all-reduce avoids.
`in_turns` alternates one worker and the pair an epoch at a time, seconds apart.
Every setting runs once per round, in 3 rounds; a scaling is the median over rounds of
a rate over its own round's one worker (this machine's speed drifts between phases).
docs/performance.md explains the method and holds the current table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

PER_WORKER_BATCH = 128  # the MLP's
ACCUMULATION = 4
ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class Model:
    """A benchmark model: its examples' shape, batch per worker and steps per epoch."""

    title: str
    shape: tuple
    per_worker_batch: int
    steps: int  # per epoch; the second epoch is measured


# The CNN's measured epoch lasts as long as DDP's: 120 steps of ~20 ms, its 60 of ~40 ms.
MODELS = {
    "mlp": Model("MLP 784-1024-1024-10", (784,), PER_WORKER_BATCH, 200),
    "cnn": Model("CNN on 32x32x3 (3 conv + 2 dense, 0.6M parameters)", (32, 32, 3), 64, 120),
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row: `workers` processes, `make_strategy(**strategy)` (None: each trains alone
    with TensorFlow's default strategy: one worker as TensorFlow trains it, two as the
    most two processes can do on these cores), optional accumulation, and the data path:
    "distribute_dataset" or "plain"."""

    workers: int
    strategy: dict | None = dataclasses.field(default_factory=dict)
    accumulation: int | None = None
    data: str = "distribute_dataset"

    @property
    def baseline(self) -> str:
        suffix = ", plain dataset" if self.data == "plain" else ""
        return f"1 worker, K={self.accumulation}" if self.accumulation else f"1 worker{suffix}"


# In each group tf_distrib's row runs right after the one-worker row it is paired with,
# leaving the VM the least time to change speed between the two.
SETTINGS = {
    "1 worker": Setting(1, None),
    "2 workers, tf_distrib (default: shm)": Setting(2),
    "2 workers, no communication (the ceiling)": Setting(2, None),
    "2 workers, TF collective": Setting(2, {"transport": "tf"}),
    "2 workers, tf_distrib tcp": Setting(2, {"transport": "tcp"}),
    "2 workers, TF collective + bf16": Setting(2, {"transport": "tf", "compression": "bf16"}),
    "2 workers, tf_distrib + bf16": Setting(2, {"compression": "bf16"}),
    "1 worker, plain dataset": Setting(1, None, data="plain"),
    "1 worker, plain dataset, tf_distrib": Setting(1, data="plain"),
    "2 workers, plain dataset, tf_distrib": Setting(2, data="plain"),
    "2 workers, plain dataset, TF collective": Setting(2, {"transport": "tf"}, data="plain"),
    f"1 worker, K={ACCUMULATION}": Setting(1, None, ACCUMULATION),
    f"2 workers, K={ACCUMULATION}, tf_distrib": Setting(2, accumulation=ACCUMULATION),
    f"2 workers, K={ACCUMULATION}, no communication": Setting(2, None, ACCUMULATION),
    f"2 workers, K={ACCUMULATION}, TF collective": Setting(2, {"transport": "tf"},
                                                          ACCUMULATION),
}
# Rows also compared with a one-worker row that is not their own baseline. One worker
# given a plain dataset under the default strategy stalls at each epoch's end while
# TensorFlow tears its iterator down (tf.data's autotuning thread, see `_input_stalls`);
# tf_distrib's strategies retire theirs off the training thread, on one CPU
# (`HostOneDeviceStrategy`) as on two workers, so the plain rows are also read against
# tf_distrib's one worker.
ALSO_AGAINST = {"2 workers, plain dataset, tf_distrib": "1 worker, plain dataset, tf_distrib"}
# The convolutional model: the rows that answer "ahead of DDP on another model".
CNN_SETTINGS = ("1 worker", "2 workers, tf_distrib (default: shm)",
                "2 workers, no communication (the ceiling)", "2 workers, TF collective",
                "1 worker, plain dataset", "1 worker, plain dataset, tf_distrib",
                "2 workers, plain dataset, tf_distrib")


def build(model: str, optimizer=None):
    """The compiled benchmark model `model` ("mlp" or "cnn"); SGD(0.01) unless given."""
    import keras

    from tf_distrib.bench.models import cnn, mlp

    optimizer = optimizer or keras.optimizers.SGD(0.01)
    return mlp((1024, 1024), optimizer=optimizer) if model == "mlp" else cnn(optimizer)


@dataclasses.dataclass(frozen=True)
class Turns:
    """Three workers that train an epoch at a time in turn: worker 2 alone, then workers
    0 and 1 as a pair, `pairs` + 1 times (the first pair is the warm-up), and worker 2 once
    more, so that every measured pair epoch lies between two epochs of one worker alone.
    Each marks an epoch's end with a file in `directory`. `alone`: the lone worker's
    `make_strategy` arguments, or None (the default): TensorFlow's default strategy."""

    directory: str
    pairs: int
    alone: dict | None = None


def train_worker(strategy_args: dict | None, accumulation: int | None = None,
                 model: str = "mlp", data: str = "distribute_dataset",
                 turns: Turns | None = None, monitoring_dir: str | None = None) -> dict:
    """One worker of the job (TF_CONFIG set, or alone), pinned to one core.

    Args:
        strategy_args: `make_strategy` arguments, or None: alone, with TensorFlow's default
            strategy.
        accumulation: `gradient_accumulation_steps`. Defaults to None (none).
        model: A key of `MODELS`. Defaults to "mlp".
        data: "distribute_dataset" or "plain" (a batched dataset given to `fit`).
            Defaults to "distribute_dataset".
        turns: Take turns with the others (3 workers: `Turns`). Defaults to None: every
            worker trains 2 epochs at once and the second is measured.
        monitoring_dir: Record every step (the launcher's status files, a `Timeline`
            and `WorkerMetrics` writing here). Defaults to None: no step is recorded.

    Returns:
        {"examples_per_sec": the job's rate, "cpu_per_step": this worker's CPU seconds,
        "in_collectives_per_step": its seconds inside the transport's collectives, or
        None without the transport}; with `turns`, lists of them, an item per epoch.
    """
    index = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    os.sched_setaffinity(0, {index % os.cpu_count()})
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tf_distrib as td
    from tf_distrib.bench import cpu_seconds

    workers = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    if turns is not None:
        workers = 2
        if index == 2:
            strategy_args, workers = turns.alone, 1
            os.environ.pop("TF_CONFIG", None)
        else:  # the pair's cluster: workers 0 and 1
            config = json.loads(os.environ["TF_CONFIG"])
            config["cluster"]["worker"] = config["cluster"]["worker"][:2]
            os.environ["TF_CONFIG"] = json.dumps(config)
            os.environ["TF_DISTRIB_NUM_WORKERS"] = "2"
    if monitoring_dir is None:  # the launcher's status files, which record every step
        os.environ.pop("TF_DISTRIB_STATUS_DIR", None)
    if strategy_args is None:  # alone, with TensorFlow's defaults
        os.environ.pop("TF_CONFIG", None)
        strategy, workers = tf.distribute.get_strategy(), 1
    else:
        strategy = td.make_strategy(**strategy_args)
    spec = MODELS[model]
    global_batch = spec.per_worker_batch * workers
    rng = np.random.default_rng(0)
    x = rng.random((global_batch * spec.steps, *spec.shape), dtype=np.float32)
    y = rng.integers(0, 10, len(x)).astype("int32")
    with strategy.scope():
        net = build(model, keras.optimizers.SGD(0.01, gradient_accumulation_steps=accumulation))
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if data == "plain":
        fit_data, steps = dataset.batch(global_batch), None
    else:
        fit_data = td.data.distribute_dataset(strategy, dataset, global_batch, repeat=True)
        steps = fit_data.steps_per_epoch

    class CpuPerStep(keras.callbacks.Callback):
        """Each epoch's CPU seconds per step; with `turns`, the epoch starts once the
        previous turn's workers have marked theirs as done (before `Throughput` starts
        its clock)."""

        def __init__(self):
            super().__init__()
            self.per_step = []

        def on_epoch_begin(self, epoch, logs=None):
            if turns is not None:
                _wait_for_turn(turns, index, epoch)
            self.start, self.steps = cpu_seconds(), 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1

        def on_epoch_end(self, epoch, logs=None):
            self.per_step.append((cpu_seconds() - self.start) / self.steps)
            if turns is not None:
                open(os.path.join(turns.directory, f"{index}-{epoch}"), "w").close()

    cpu = CpuPerStep()
    epochs = 2 if turns is None else turns.pairs + 1 + (index == 2)
    watching = [] if monitoring_dir is None else [
        td.callbacks.Timeline(os.path.join(monitoring_dir, "trace.json")),
        td.callbacks.WorkerMetrics(os.path.join(monitoring_dir, "tensorboard"))]
    history = net.fit(fit_data, epochs=epochs, steps_per_epoch=steps, verbose=0,
                      callbacks=[cpu, td.callbacks.Throughput(global_batch), *watching])
    rates = history.history["examples_per_sec"]
    busy = history.history.get("busy_time")  # only with tf_distrib's transport
    collectives = ([global_batch / r - b for r, b in zip(rates, busy, strict=True)]
                   if busy else [None] * len(rates))
    if turns is None:
        return {"examples_per_sec": rates[-1], "cpu_per_step": cpu.per_step[-1],
                "in_collectives_per_step": collectives[-1]}
    return {"examples_per_sec": rates, "cpu_per_step": cpu.per_step,
            "in_collectives_per_step": collectives}


def _wait_for_turn(turns: Turns, index: int, epoch: int, timeout: float = 300) -> None:
    """Worker 2's epoch e follows the pair's epoch e - 1; the pair's follows worker 2's."""
    if index < 2:
        before = [f"2-{epoch}"]
    else:
        before = [f"0-{epoch - 1}", f"1-{epoch - 1}"] if epoch else []
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(turns.directory, name)) for name in before):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {index} waited {timeout:.0f} s for its turn at epoch "
                               f"{epoch}: no end of {before} in {turns.directory}")
        time.sleep(0.005)


def all_reduce_floor(nbytes: int, repeats: int = 50) -> float:
    """Seconds of memory work per all-reduce of `nbytes` for each of 2 workers.

    In the transport's in-place all-reduce a worker copies the half its peer sums into
    shared memory and sums its own half with the peer's copy; nothing less can sum
    two workers' gradients that TensorFlow computed in private memory. Timed here in
    one process pinned to one core, with no peer to share the memory with: a lower
    bound on what the second worker adds to each step.

    Args:
        nbytes: The gradients' bytes (float32).
        repeats: Timed repetitions. Defaults to 50.

    Returns:
        The median seconds of one copy and one sum.
    """
    import time

    import numpy as np

    half = nbytes // 8
    gradients, peer = np.ones((2, 2 * half), np.float32)
    shared, total = np.empty((2, half), np.float32)
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(affinity)})
    try:
        times = []
        for _ in range(repeats + 5):
            began = time.perf_counter()
            shared[:] = gradients[half:]
            np.add(gradients[:half], peer[:half], out=total)
            times.append(time.perf_counter() - began)
    finally:
        os.sched_setaffinity(0, affinity)
    return statistics.median(times[5:])


# Accumulation that never reaches an update: the workers meet at every step (Keras'
# logged loss) but exchange no gradients, so that this row, between K=4's pair and the
# ceiling, tells what the meetings cost on these cores from what the exchange costs.
NEVER = 1_000_000
# Rows measured in turns (`in_turns`) on the MLP: tf_distrib's two data paths, whose
# overhead the goal is about, and accumulation, each with the ceiling to read it against.
TURNS = {name: SETTINGS[name] for name in (
    "2 workers, tf_distrib (default: shm)", "2 workers, plain dataset, tf_distrib",
    "2 workers, no communication (the ceiling)", f"2 workers, K={ACCUMULATION}, tf_distrib",
    f"2 workers, K={ACCUMULATION}, no communication")}
TURNS["2 workers, tf_distrib, synchronised, no exchange"] = Setting(2, accumulation=NEVER)
PAIRS = 8


def in_turns(setting: Setting, pairs: int = PAIRS) -> dict:
    """The MLP's `setting` against one worker alone, an epoch each in turn (`Turns`).

    Each of the `pairs` measured epochs of the two workers is compared with the mean of
    the one-worker epochs just before and after it (a few seconds apart, where the rounds
    of `run` are minutes apart), so that the VM's changes of speed cancel out.

    Args:
        setting: A 2-worker `Setting`; the lone worker takes its accumulation.
        pairs: Measured epochs of each. Defaults to `PAIRS`.

    Returns:
        {"scaling": [per pair], "examples_per_sec": [per pair],
        "one_worker_examples_per_sec": [around each pair], "overhead_ms_per_step": [per
        pair], "in_collectives_ms_per_step": [per pair], or None without the transport}.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        values = _launch(3, setting.strategy, setting.accumulation, "mlp", setting.data,
                         Turns(directory, pairs))
    return compare_turns(values, pairs, apart=setting.strategy is None)


def _launch(workers: int, *args) -> list:
    """The values `train_worker(*args)` returns on each of `workers` launched workers."""
    from tf_distrib.launch import launch

    result = launch(train_worker, workers, args=args, quiet=True, timeout=900)
    if result.exit_code:
        raise RuntimeError(result.failure_report())
    return result.values


def _job_rate(rates: list, apart: bool) -> float:
    """The job's examples/s from its workers' (each measures the job's; workers that
    train `apart` add theirs)."""
    return sum(rates) if apart else rates[0]


def compare_turns(values: list, pairs: int, apart: bool) -> dict:
    """`in_turns`' figures from its 3 workers' per-epoch measurements (`train_worker`'s):
    the pair's epoch e against the mean of worker 2's epochs e and e + 1; `apart`: the
    pair trained without communicating (`_job_rate`)."""
    *pair, alone = values

    def around(key, epoch):
        return (alone[key][epoch] + alone[key][epoch + 1]) / 2

    def rate(epoch):
        return _job_rate([w["examples_per_sec"][epoch] for w in pair], apart)

    measured = range(1, pairs + 1)  # the pair's epoch 0 is the warm-up
    collectives = [_mean([w["in_collectives_per_step"][e] for w in pair]) for e in measured]
    return {"scaling": [rate(e) / around("examples_per_sec", e) for e in measured],
            "examples_per_sec": [rate(e) for e in measured],
            "one_worker_examples_per_sec": [around("examples_per_sec", e) for e in measured],
            "overhead_ms_per_step": [
                (statistics.mean(w["cpu_per_step"][e] for w in pair)
                 - around("cpu_per_step", e)) * 1e3 for e in measured],
            "in_collectives_ms_per_step": None if None in collectives
            else [c * 1e3 for c in collectives]}


def run(options) -> dict:
    from tf_distrib.bench import pytorch_ddp

    def tf_run(model, setting):
        values = _launch(setting.workers, setting.strategy, setting.accumulation, model,
                         setting.data)
        return {"examples_per_sec": _job_rate([v["examples_per_sec"] for v in values],
                                              apart=setting.strategy is None),
                "cpu_per_step": statistics.mean(v["cpu_per_step"] for v in values),
                "in_collectives_per_step": _mean([v["in_collectives_per_step"]
                                                  for v in values])}

    report = {}
    for model in MODELS:
        names = SETTINGS if model == "mlp" else CNN_SETTINGS
        # name -> (the one-worker row it is compared to, a run returning its measurements)
        runs = {name: (SETTINGS[name].baseline, lambda m=model, s=SETTINGS[name]: tf_run(m, s))
                for name in names}
        if pytorch_ddp.available():
            ddp = [("", 1)] + ([(f", K={ACCUMULATION} (no_sync)", ACCUMULATION)]
                               if model == "mlp" else [])
            for suffix, k in ddp:
                for name, workers in ((f"PyTorch, 1 process{suffix}", 1),
                                      (f"PyTorch DDP (gloo), 2 processes{suffix}", 2)):
                    runs[name] = (f"PyTorch, 1 process{suffix}", lambda w=workers, k=k, m=model:
                                  pytorch_ddp.measure(w, model=m, accumulation=k,
                                                      batch=MODELS[m].per_worker_batch))
        report[model] = _rounds(runs, 1 if options.quick else ROUNDS)
        report[model]["also_against"] = {
            name: _scaling_against(report[model], name, baseline)
            for name, baseline in ALSO_AGAINST.items() if name in runs}
        report[model]["all_reduce_floor_ms"] = all_reduce_floor(
            4 * build(model).count_params()) * 1e3
        _print(MODELS[model], runs, report[model])
        if model == "mlp":
            report["mlp_in_turns"] = {name: in_turns(setting, 2 if options.quick else PAIRS)
                                      for name, setting in TURNS.items()}
            _print_turns(report["mlp_in_turns"])
    if not pytorch_ddp.available():
        print("  (PyTorch DDP rows: torch is not installed)")
    return report


def _rounds(runs: dict, rounds: int) -> dict:
    """Every run of `runs` once per round; each row's scaling and overhead against its
    baseline's run of the same round, and their medians over rounds."""
    measured = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (_, measure) in runs.items():
            measured[name].append(measure())

    def per_round(name, baseline, key, combine):
        return [combine(m[key], one[key])
                for m, one in zip(measured[name], measured[baseline], strict=True)]

    scaling = {name: per_round(name, baseline, "examples_per_sec", lambda r, one: r / one)
               for name, (baseline, _) in runs.items()}
    overhead = {name: per_round(name, baseline, "cpu_per_step",
                                lambda c, one: (c - one) * 1e3)
                for name, (baseline, _) in runs.items()}
    return {"examples_per_sec": {name: statistics.median(m["examples_per_sec"] for m in ms)
                                 for name, ms in measured.items()},
            "examples_per_sec_per_round": {name: [m["examples_per_sec"] for m in ms]
                                           for name, ms in measured.items()},
            "scaling": {name: statistics.median(s) for name, s in scaling.items()},
            "scaling_per_round": scaling,
            "cpu_ms_per_step": {name: statistics.median(m["cpu_per_step"] for m in ms) * 1e3
                                for name, ms in measured.items()},
            "overhead_ms_per_step": {name: statistics.median(o) for name, o in overhead.items()},
            "overhead_ms_per_round": overhead,
            "in_collectives_ms_per_step": {
                name: statistics.median(m["in_collectives_per_step"] for m in ms) * 1e3
                for name, ms in measured.items()
                if ms[0].get("in_collectives_per_step") is not None},
            "rounds": rounds}


def _scaling_against(report: dict, name: str, baseline: str) -> float:
    """Row `name`'s median scaling over rounds against row `baseline` of the same round."""
    rates = report["examples_per_sec_per_round"]
    return statistics.median(rate / one for rate, one in
                             zip(rates[name], rates[baseline], strict=True))


def _print(model: Model, runs: dict, report: dict) -> None:
    print(f"{model.title}, {model.per_worker_batch} examples per worker per step, one core "
          f"and one intra-op thread per worker; medians of {report['rounds']} round(s); "
          "overhead: CPU ms per step of a worker minus its one-worker row's in the same "
          "round (lowest to highest round); in collectives: ms per step inside the "
          "transport's collectives")
    print(f"  {'setting':<48}{'examples/s':>12}{'scaling':>10}{'CPU ms/step':>13}"
          f"{'overhead':>10}{'rounds':>16}{'in collectives':>16}")
    for name in runs:
        rounds = report["overhead_ms_per_round"][name]
        collectives = report["in_collectives_ms_per_step"].get(name)
        print(f"  {name:<48}{report['examples_per_sec'][name]:>12.0f}"
              f"{report['scaling'][name]:>9.2f}x{report['cpu_ms_per_step'][name]:>13.2f}"
              f"{report['overhead_ms_per_step'][name]:>10.2f}"
              f"{_spread(rounds):>16}"
              f"{_ms(collectives):>16}")
    for name, scaling in report["also_against"].items():
        print(f"  {name}, against {ALSO_AGAINST[name]!r}: {scaling:.2f}x")
    for name, setting in SETTINGS.items():
        if name in runs and setting.workers == 1 and setting.data == "plain":
            wall = model.per_worker_batch / report["examples_per_sec"][name]
            idle = wall * 1e3 - report["cpu_ms_per_step"][name]
            why = (" (the default strategy tears each epoch's iterator down at its end)"
                   if setting.strategy is None else "")
            print(f"  {name}: {idle:.2f} ms of its {wall * 1e3:.2f} ms per step without "
                  f"CPU{why}")
    print(f"  overhead floor (copy and sum of the gradients' halves, one process): "
          f"{report['all_reduce_floor_ms']:.2f} ms per all-reduce")


def _print_turns(turns: dict) -> None:
    pairs = len(next(iter(turns.values()))["scaling"])
    print("  in turns (one worker alone and the two workers train an epoch each in "
          "alternation; each 2-worker epoch against the one-worker epochs around it): "
          f"median (lowest to highest) of {pairs} epochs")
    for name, measured in turns.items():
        scaling, overhead = measured["scaling"], measured["overhead_ms_per_step"]
        collectives = measured["in_collectives_ms_per_step"]
        print(f"  {name:<48}{'':>12}{statistics.median(scaling):>9.2f}x{'':>13}"
              f"{statistics.median(overhead):>10.2f}"
              f"{_spread(overhead):>16}"
              f"{_ms(collectives and statistics.median(collectives)):>16}")


def _spread(values: list) -> str:
    return f"{min(values):.1f} to {max(values):.1f}"


def _mean(values: list) -> float | None:
    """The workers' mean; None when they ran without the transport (None each)."""
    return None if None in values else statistics.mean(values)


def _ms(value: float | None) -> str:
    """A cell of milliseconds; empty for rows without the transport."""
    return "" if value is None else f"{value:.2f}"
