"""The native all-reduce ops in real worker processes: over shared memory
(tf_distrib/transport/native_sum.cc) and, for small all-reduces, over TCP
(native_exchange.cc)."""

import hashlib
import os
import warnings

import numpy as np
import pytest

from tf_distrib import transport
from tf_distrib.launch import launch
from tf_distrib.testing import run_workers
from tf_distrib.transport import native_sum

pytestmark = pytest.mark.multiprocess


def _connect(directory, **kwargs):
    import tensorflow  # noqa: F401  (the op serves TensorFlow: bound only once it is loaded)

    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    world = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    return transport.connect(rank, [f"worker:{r}" for r in range(world)], "127.0.0.1",
                             transport.FileStore(directory), secret=b"s", timeout=60,
                             **kwargs)


def _addends(rank, sizes, dtype=np.float32):
    rng = np.random.default_rng(rank)
    if dtype == np.int64:  # TensorFlow's per-step count of the workers that have data
        return [rng.integers(-1000, 1000, n) for n in sizes]
    return [(rng.standard_normal(n) * 4).astype(dtype) for n in sizes]


def sum_both_ways(directory):
    """Each layout summed by the op and by the Python path, alternately (they share the
    segment's counters); the sums come back as digests, with one exactness check each."""
    import tensorflow as tf

    from tf_distrib.transport import graph_op
    from tf_distrib.transport.sgd_step import SgdStep

    t = _connect(directory)
    rank, world = t.rank, t.world
    slot = t.in_place_bytes // 4
    # One element up; sizes no worker count divides; a layout of two slot-sized chunks;
    # int64.
    layouts = [([1], np.float32), ([7, 1000], np.float32), ([65_537, 3, 250_000], np.float32),
               ([slot + 17], np.float32), ([1, 9, 1000], np.int64)]
    report = {"native": t.native is not None, "digests": [], "equal": [], "exact": [],
              "sgd": []}
    for sizes, dtype in layouts:
        mine = _addends(rank, sizes, dtype)
        native = [np.asarray(s) for s in graph_op.all_reduce(t, mine)]
        python = [np.array(s) for s in t.all_reduce(mine)]
        again = [np.asarray(s) for s in graph_op.all_reduce(t, mine)]
        report["equal"].append(all(np.array_equal(a, b) and np.array_equal(a, c)
                                   for a, b, c in zip(native, python, again, strict=True)))
        if dtype == np.float32:  # the SGD steps fused into the op, as numpy rounds them
            rate, momentum = np.float32(0.1), np.float32(0.9)
            weights, velocities = _addends(world, sizes), _addends(world + 1, sizes)
            stepped = [tf.Variable(w) for w in weights]
            accelerated = [tf.Variable(w) for w in (*weights, *velocities)]
            graph_op.sgd(t, SgdStep(rate, stepped), mine)
            graph_op.sgd(t, SgdStep(rate, accelerated[:len(sizes)], momentum,
                                    accelerated[len(sizes):]), mine)
            expected = [m * momentum - s * rate for m, s in zip(velocities, python, strict=True)]
            expected = [*(w + v for w, v in zip(weights, expected, strict=True)), *expected]
            report["sgd"].append(
                all(np.array_equal(u.numpy(), w - s * rate)
                    for u, w, s in zip(stepped, weights, python, strict=True))
                and all(np.array_equal(u.numpy(), e)
                        for u, e in zip(accelerated, expected, strict=True)))
        reference = [sum(_addends(r, sizes, dtype)[k].astype(np.float64) for r in range(world))
                     for k in range(len(sizes))]
        report["exact"].append(all(s.dtype == dtype and np.allclose(s, r, rtol=1e-5, atol=1e-4)
                                   for s, r in zip(native, reference, strict=True)))
        report["digests"].append(hashlib.sha256(b"".join(s.tobytes() for s in native))
                                 .hexdigest())
    report["collectives"] = t.stats.collectives
    t.close()
    try:  # a step traced before the transport closed fails, and touches nothing
        graph_op.all_reduce(t, mine)
    except tf.errors.UnknownError as e:
        report["after_close"] = e.message
    return report


def exchange_both_ways(directory):
    """Over TCP, each layout summed by the exchange op (in a traced function, and eagerly)
    and by the Python path; one too large for the op."""
    import tensorflow as tf

    from tf_distrib.transport import graph_op

    t = _connect(directory, mode="tcp")
    rank, world = t.rank, t.world
    # One element; sizes no worker count divides; int64; one past the exchange's bytes.
    layouts = [([1], np.float32), ([7, 1000], np.float32), ([1, 9, 1000], np.int64),
               ([40_000], np.float32)]
    report = {"exchange": t.exchange is not None, "digests": [], "equal": [], "exact": []}
    for sizes, dtype in layouts:
        mine = _addends(rank, sizes, dtype)
        traced = [np.asarray(s) for s in tf.function(
            lambda *arrays: graph_op.all_reduce(t, list(arrays)))(*mine)]
        python = [np.array(s) for s in t.all_reduce(mine)]
        eager = [np.asarray(s) for s in graph_op.all_reduce(t, mine)]
        report["equal"].append(all(np.array_equal(a, b) and np.array_equal(a, c)
                                   for a, b, c in zip(traced, python, eager, strict=True)))
        reference = [sum(_addends(r, sizes, dtype)[k].astype(np.float64) for r in range(world))
                     for k in range(len(sizes))]
        report["exact"].append(all(s.dtype == dtype and np.allclose(s, r, rtol=1e-5, atol=1e-4)
                                   for s, r in zip(traced, reference, strict=True)))
        report["digests"].append(hashlib.sha256(b"".join(s.tobytes() for s in traced))
                                 .hexdigest())
    report["collectives"] = t.stats.collectives
    report["by_the_op"] = [r["bytes"] for r in t.exchange.recent()]
    t.close()
    return report


def test_the_exchange_op_sums_small_layouts_bitwise_as_the_python_path(tmp_path):
    workers = run_workers(exchange_both_ways, 3, args=(str(tmp_path),), startup_timeout=None,
                          quiet=True, timeout=180)
    for w in workers:
        assert w.value["exchange"]
        assert w.value["equal"] == [True] * 4
        assert w.value["exact"] == [True] * 4
        assert w.value["collectives"] == 3 * 4
        # The op ran the small layouts (traced and eager), not the large one.
        assert w.value["by_the_op"] == [4, 4, 4 * 1007, 4 * 1007, 8 * 1010, 8 * 1010]
    assert len({tuple(w.value["digests"]) for w in workers}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_the_op_sums_bitwise_as_the_python_path_on_every_worker(tmp_path, world):
    workers = run_workers(sum_both_ways, world, args=(str(tmp_path),), startup_timeout=None,
                          quiet=True, timeout=180)
    for w in workers:
        assert w.value["native"]
        assert w.value["equal"] == [True] * 5
        assert w.value["exact"] == [True] * 5
        assert w.value["sgd"] == [True] * 4
        assert w.value["collectives"] == 3 * 5 + 2 * 4  # the op's are counted too
        assert ("tf_distrib.transport.errors.TransportError: the transport is closed."
                in w.value["after_close"])
    assert len({tuple(w.value["digests"]) for w in workers}) == 1


SGD_SETTINGS = {"plain": {}, "K=4": {"gradient_accumulation_steps": 4},
                "clipped, decayed": {"clipnorm": 0.5, "weight_decay": 0.01},
                "momentum": {"momentum": 0.9},
                "Nesterov, K=2": {"momentum": 0.5, "nesterov": True,
                                  "gradient_accumulation_steps": 2}}


def fit_with_sgd_fused_and_not():
    """The same model trained with Keras' SGD (its step fused into the op) and with an SGD
    whose `update_step` is overridden (Keras' own step): plain, with accumulation, with
    clipping and weight decay, with momentum, with Nesterov's. Returns whether each pair
    ends bitwise equal, a digest of the weights, how many fused steps each traced, and
    how many of its updates went to an update region, in place."""
    import gc

    import keras
    import tensorflow as tf

    import tf_distrib as td
    from tf_distrib.cross_device.gradients import of_strategy
    from tf_distrib.transport.native_sum import NativeSum

    traced = []
    fused = NativeSum.sgd
    NativeSum.sgd = lambda self, *args, **kwargs: traced.append(1) or fused(self, *args, **kwargs)

    class KerasSGD(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)

    strategy = td.make_strategy()
    native = of_strategy(strategy).transport.native
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((512, 20)).astype("float32"), rng.integers(0, 5, 512)
    data = td.data.distribute_dataset(strategy, tf.data.Dataset.from_tensor_slices((x, y)),
                                      64)

    def train(optimizer, label, **kwargs):
        label = label if optimizer is keras.optimizers.SGD else f"Keras' step {label}"
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((20,)),
                                      keras.layers.Dense(300, activation="relu"),
                                      keras.layers.Dense(5)])
            model.compile(optimizer(0.05, **kwargs),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        gc.collect()  # the models trained before, and the regions they held
        before = len(traced), native.region_updates, native.in_place_updates
        model.fit(data, epochs=2, verbose=0)
        # Keras counts the optimizer's updates: one per K steps with accumulation.
        report[f"updates {label}"] = int(model.optimizer.iterations.numpy())
        report[f"region updates {label}"] = native.region_updates - before[1]
        report[f"in place {label}"] = native.in_place_updates - before[2]
        return [w.numpy() for w in model.weights], len(traced) - before[0]

    report = {}
    for label, kwargs in SGD_SETTINGS.items():
        (a, report[f"traced {label}"]), (b, report[f"Keras' step traced {label}"]) = (
            train(cls, label, **kwargs) for cls in (keras.optimizers.SGD, KerasSGD))
        report[f"equal {label}"] = all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
        report[f"digest {label}"] = hashlib.sha256(b"".join(w.tobytes() for w in a)).hexdigest()
    return report


def test_keras_sgd_fused_into_the_op_steps_bitwise_as_keras():
    workers = run_workers(fit_with_sgd_fused_and_not, 2, startup_timeout=None, quiet=True,
                          timeout=180)
    a, b = (w.value for w in workers)
    assert a == b  # every worker ends with the same weights
    for label in SGD_SETTINGS:
        assert a[f"equal {label}"] and a[f"traced {label}"] >= 1, a
        assert a[f"Keras' step traced {label}"] == 0, a
        # Each model's variables take a free region, then are updated there in place;
        # Keras' weight decay (`assign_sub`) copies them out of it before every step.
        assert a[f"region updates {label}"] == a[f"updates {label}"], a
        in_place = 0 if "decayed" in label else a[f"updates {label}"] - 1
        assert a[f"in place {label}"] == in_place, a
    assert a["updates plain"] == 16 and a["updates K=4"] == 4, a


def step_while_values_are_held(directory):
    """Fused SGD steps run eagerly while worker 0 holds reads of the weights (values in the
    update regions), then an `assign_sub` on one worker at a time; returns what each saw."""
    import tensorflow as tf

    from tf_distrib.transport import graph_op
    from tf_distrib.transport.sgd_step import SgdStep

    t = _connect(directory)
    gradient = [np.full(1000, t.rank + 1, np.float32)]  # 3 summed over 2 workers
    weights = [tf.Variable(np.zeros(1000, np.float32))]
    held, report = [], {}

    def step():
        graph_op.sgd(t, SgdStep(np.float32(0.5), weights), gradient)
        report.setdefault("regions", []).append(t.native.region_updates)
        report.setdefault("in place", []).append(t.native.in_place_updates)

    step()  # into region 0
    if t.rank == 0:
        held.append(weights[0].read_value())
    step()  # region 1: worker 0 holds region 0
    if t.rank == 0:
        held.append(weights[0].read_value())
    step()  # private: worker 0 holds both
    report["held"] = [h.numpy().tolist() for h in held]
    held.clear()
    step()  # region 0
    step()  # region 0, in place
    report["after 5"] = weights[0].numpy().tolist()
    for rank in range(t.world):
        if t.rank == rank:
            weights[0].assign_sub(np.ones(1000, np.float32))
        graph_op.all_reduce(t, [np.zeros(1, np.float32)])  # one at a time
        report[f"after worker {rank}'s assign_sub"] = weights[0].numpy().tolist()
    t.close()
    return report


def test_values_a_worker_still_holds_are_never_written(tmp_path):
    """Workers' variables share an update region; one worker's held values keep every
    worker from writing where they are, and TensorFlow's in-place updates copy the region
    first (a peer never sees them)."""
    workers = run_workers(step_while_values_are_held, 2, args=(str(tmp_path),),
                          startup_timeout=None, quiet=True, timeout=120)
    first, second = (w.value for w in workers)
    for report in (first, second):
        assert report["regions"] == [1, 2, 2, 3, 4]  # the third step in private buffers
        assert report["in place"] == [0, 0, 0, 0, 1]
        assert report["after 5"] == [-7.5] * 1000
    assert first["held"] == [[-1.5] * 1000, [-3.0] * 1000]  # as read, never overwritten
    assert first["after worker 0's assign_sub"] == [-8.5] * 1000
    assert second["after worker 0's assign_sub"] == [-7.5] * 1000
    assert second["after worker 1's assign_sub"] == [-8.5] * 1000
    assert first["after worker 1's assign_sub"] == [-8.5] * 1000


def seconds_to_training(directory):
    """Seconds from the end of this worker's first collective (the op's) until it reports
    the TRAINING phase, with the watcher's liveness poll too slow to notice by polling."""
    import time

    from tf_distrib.health import phases
    from tf_distrib.transport import graph_op, shared_memory

    shared_memory.CHECK_SECONDS = 60.0
    t = _connect(directory)
    graph_op.all_reduce(t, [np.ones(8, np.float32)])
    done, deadline = time.monotonic(), time.monotonic() + 10
    while phases.current() != phases.TRAINING and time.monotonic() < deadline:
        time.sleep(0.001)
    return time.monotonic() - done


def test_the_first_collective_reports_training_at_once(tmp_path):
    # The launcher names the phase of a worker that stops (SIGSTOP); one that stopped at
    # its 15th step was said to be "in its first step" while the watcher had not polled.
    workers = run_workers(seconds_to_training, 2, args=(str(tmp_path),),
                          startup_timeout=None, quiet=True, timeout=120)
    assert all(w.value < 1.0 for w in workers), [w.value for w in workers]


# Elements each op sums in `lose_a_peer_in_the_op`: over TCP, few enough for the exchange.
LOST_PEER_ELEMENTS = {"shm": 100_000, "tcp": 1000}


def lose_a_peer_in_the_op(directory, how, mode):
    """Worker 1 dies (SIGKILL) or freezes (SIGSTOP) while the others wait in the op."""
    import contextlib
    import signal
    import time

    import tensorflow as tf

    from tf_distrib.transport import graph_op

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the survivors report
    t = _connect(directory, peer_timeout=3.0, mode=mode)
    assert (t.native if mode == "shm" else t.exchange) is not None
    data = [np.ones(LOST_PEER_ELEMENTS[mode], np.float32)]
    graph_op.all_reduce(t, data)
    if t.rank == 1:
        with open(os.path.join(directory, "pid"), "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), getattr(signal, how))
    start = time.monotonic()
    try:
        graph_op.all_reduce(t, data)
    except tf.errors.UnknownError as e:
        lost = {"seconds": time.monotonic() - start, "error": e.message,
                "failure": str(t.failure), "recent": t.recent()}
    if t.rank == 0:
        time.sleep(1.0)  # the other survivor notices by itself, or is told
        with open(os.path.join(directory, "pid")) as f, contextlib.suppress(ProcessLookupError):
            os.kill(int(f.read()), signal.SIGKILL)
    return lost


@pytest.mark.parametrize("mode", ["shm", "tcp"])
@pytest.mark.parametrize("how, limit", [("SIGKILL", 2.0), ("SIGSTOP", 3.0 + 2.5)])
def test_a_lost_peer_fails_the_op_in_bounded_time_naming_it(tmp_path, how, limit, mode):
    result = launch(lose_a_peer_in_the_op, 3, args=(str(tmp_path), how, mode),
                    startup_timeout=None, quiet=True, timeout=90, grace_period=30)
    assert result.exit_codes == [[0, -9, 0]]
    for survivor in (result.workers[0], result.workers[2]):
        lost = survivor.value
        assert lost["seconds"] < limit, lost
        # The transport's own error, in the op's: the console and the launcher read it.
        assert "PeerLostError: worker:1 (127.0.0.1:" in lost["error"], lost
        assert lost["failure"] in lost["error"], lost
        if how == "SIGSTOP":
            assert "sent nothing for" in lost["error"]
        # The flight recorder lists the op's collectives: the first ended, the lost one not.
        done, stuck = lost["recent"][-2:]
        nbytes = 4 * LOST_PEER_ELEMENTS[mode]
        assert (done["bytes"], stuck["bytes"], stuck["seq"]) == (nbytes, nbytes,
                                                                 done["seq"] + 1), lost
        assert done["started"] <= done["ended"] <= stuck["started"], lost
        assert stuck["ended"] is None, lost


def sum_different_sizes(directory, mode="auto"):
    from tf_distrib.transport import graph_op

    t = _connect(directory, mode=mode)
    graph_op.all_reduce(t, [np.ones(3, np.float32)])
    try:
        graph_op.all_reduce(t, [np.ones(40 if t.rank else 4, np.float32)])
    except Exception as e:  # noqa: BLE001  (the test reads the message)
        return f"{type(e).__name__}: {e}"
    finally:
        t.close()


def sum_against_an_sgd_step(directory, mode):
    """Worker 0 takes a fused SGD step where worker 1 sums as many bytes."""
    import tensorflow as tf

    from tf_distrib.transport import graph_op
    from tf_distrib.transport.sgd_step import SgdStep

    t = _connect(directory, mode=mode)
    ones = [np.ones(3, np.float32)]
    try:
        if t.rank == 0:
            graph_op.sgd(t, SgdStep(np.float32(0.1), [tf.Variable(ones[0])]), ones)
        else:
            graph_op.all_reduce(t, ones)
    except Exception as e:  # noqa: BLE001  (the test reads the message)
        return f"{type(e).__name__}: {e}"
    finally:
        t.close()


@pytest.mark.parametrize("job, mode, names", [
    (sum_different_sizes, "shm", ("float32", "float32")),
    (sum_different_sizes, "tcp", ("float32", "float32")),
    (sum_against_an_sgd_step, "shm", ("f32 sgd", "float32"))])
def test_workers_that_sum_different_layouts_fail_instead_of_summing(tmp_path, job, mode, names):
    messages = [w.value for w in run_workers(job, 2, args=(str(tmp_path), mode),
                                             startup_timeout=None, quiet=True, timeout=60)]
    assert all("ProtocolError: worker" in m and "runs a different collective" in m
               for m in messages), messages
    assert all(f"bytes of {name})" in m for m in messages for name in names), messages


def connect_and_sum(directory):
    from tf_distrib.transport import graph_op

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = _connect(directory)
    try:
        [total] = graph_op.all_reduce(t, [np.full(1000, t.rank + 1.0, np.float32)])
        return {"native": t.native is not None, "total": float(np.asarray(total)[0]),
                "warnings": [str(w.message) for w in caught]}
    finally:
        t.close()


@pytest.mark.parametrize("env, warns", [({"CXX": "false"}, True),
                                        ({"TF_DISTRIB_NATIVE_SUM": "0"}, False)],
                         ids=["no-compiler", "switched-off"])
def test_without_the_op_every_worker_keeps_the_python_path(tmp_path, env, warns):
    env = {**env, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # nothing built there yet
    workers = run_workers(connect_and_sum, 2, args=(str(tmp_path),), env=env,
                          startup_timeout=None, quiet=True, timeout=120)
    for w in workers:
        assert w.value["native"] is False and w.value["total"] == 3.0
        named = [m for m in w.value["warnings"] if "native ops are not used" in m]
        assert bool(named) == warns, w.value["warnings"]
        if warns:  # the cause, not a generic "install a compiler": this one exists, and fails
            assert "false failed to compile the native ops (exit status 1)" in named[0]
            assert "keeps its Python path" in named[0]


@pytest.mark.parametrize("value", ["yes", "2"])
def test_a_bad_switch_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("TF_DISTRIB_NATIVE_SUM", value)
    with pytest.raises(ValueError, match="TF_DISTRIB_NATIVE_SUM=.*Fix or unset"):
        native_sum.enabled()
