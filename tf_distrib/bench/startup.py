"""How long a launch takes to start its workers: fresh interpreters against `preload`.

The same 2-worker MultiWorkerMirroredStrategy job (`make_strategy`, a small Keras model,
one short epoch through `distribute_dataset`) is launched in paired rounds, once with a
fresh Python process per worker (the default, as torchrun and TensorFlow's tutorials
start workers) and once forked from the preload server
(`tf_distrib.launch.forkserver`), and once more each with worker 1 failing after its
first epoch, so that the second attempt's time is a restart's. The first preloaded
launch also starts the server; it is shown on its own.
"""

from __future__ import annotations

import statistics
import time

EXAMPLES = 1024


def _job(fail_once: bool) -> float:
    import os

    import keras
    import numpy as np
    import tensorflow as tf

    import tf_distrib as td

    strategy = td.make_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(EXAMPLES, 32)).astype("float32")
    dataset = td.data.distribute_dataset(
        strategy, tf.data.Dataset.from_tensor_slices((features, features[:, :1])),
        global_batch_size=64)
    history = model.fit(dataset, epochs=1, verbose=0)
    if fail_once and os.environ[td.launch.ENV_ATTEMPT] == "0" \
            and os.environ[td.launch.ENV_WORKER_INDEX] == "1":
        raise SystemExit(3)
    return history.history["loss"][-1]


def _launch(preload: bool, fail_once: bool) -> tuple[float, float]:
    """(seconds of the whole launch, seconds of its last attempt)."""
    from tf_distrib.launch import launch

    start = time.monotonic()
    result = launch(_job, 2, args=(fail_once,), max_restarts=int(fail_once), quiet=True,
                    timeout=600, preload=preload)
    if result.exit_code:
        raise RuntimeError(result.failure_report())
    return time.monotonic() - start, result.attempts[-1].seconds


def run(options) -> dict:
    from tf_distrib.launch import forkserver

    rounds = 1 if options.quick else 3
    forkserver.close_all()
    first = _launch(preload=True, fail_once=False)[0]
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for preload in (False, True):
            name = "preloaded" if preload else "fresh processes"
            times.setdefault(f"launch, {name}", []).append(_launch(preload, False)[0])
            times.setdefault(f"restart, {name}", []).append(_launch(preload, True)[1])
    forkserver.close_all()
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"2 MWMS workers, one epoch of {EXAMPLES} examples; median of {rounds} paired "
          "round(s)")
    print(f"  {'':<30}{'seconds':>9}{'vs fresh':>10}")
    print(f"  {'first launch, server starts':<30}{first:>9.2f}"
          f"{medians['launch, fresh processes'] / first:>9.2f}x")
    for name, seconds in medians.items():
        fresh = medians[name.split(",")[0] + ", fresh processes"]
        print(f"  {name:<30}{seconds:>9.2f}{fresh / seconds:>9.2f}x")
    return {"seconds": {"first launch, server starts": first, **medians}, "rounds": times}
