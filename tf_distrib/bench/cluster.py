"""The transport's all-reduce across simulated hosts on shaped links, and a cost model.

2, 3 and 4 simulated hosts (`tf_distrib.testing.SimulatedHosts`) at 1 and 10 Gbit/s
all-reduce the benchmark MLP's gradient (7.4 MB of float32, and its bfloat16 half); each
row is the median over `PASSES` passes of the slowest worker's median over `REPEATS`.
"link use" is the bytes a host sends per all-reduce over the time and the link rate. The
cost model (`calibrate`, `predict`) is fitted on the 2-host rows and printed against the
others, and projected to 512 workers (also for PowerSGD). Then the three small
all-reduces of a PowerSGD step on 2 hosts, by the native exchange op against the
transport's Python path. Then `fit` on 2 hosts x 1 worker (TensorFlow's collective,
tf_distrib, with bf16, with PowerSGD, PyTorch DDP when installed) against one worker of
the same framework (tf.distribute's settings an epoch at a time in turn with it), and how
much of the all-reduce hid behind backward ("hidden"). Needs root (`SimulatedHosts`);
skipped, naming what is missing, without it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tf_distrib.transport import halving_doubling

# Link rates in bits/s: those measured, and those the cost model projects to.
_BITS = {"1gbit": 1e9, "10gbit": 10e9, "25gbit": 25e9, "100gbit": 100e9}
RATES = {rate: _BITS[rate] for rate in ("1gbit", "10gbit")}
# Hosts x 1 worker for the cost model: calibrated on 2 hosts, checked on 3 and 4.
HOST_COUNTS = (2, 3, 4)
GRADIENT_FLOATS = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
REPEATS = 20
# Passes over every row (its figure: the median over passes; "rounds" are the ring's).
PASSES = 3
DTYPES = {"float32": 4, "bfloat16": 2}  # name -> bytes per element
# (workers per host, transport mode as connect() takes it)
LAYOUTS = ((1, "tcp"), (2, "tcp"), (2, "auto"))


def _worker(store: str, rank: int, world: int, host: str, mode: str, dtype_name: str) -> None:
    """One worker: prints the seconds of each timed all-reduce as JSON."""
    import ml_dtypes
    import numpy as np

    from tf_distrib import transport

    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.float32
    t = transport.connect(rank, [f"worker:{r}" for r in range(world)], host,
                          transport.FileStore(store), secret=b"bench", mode=mode, timeout=60)
    try:
        grads = [np.random.default_rng(rank).standard_normal(GRADIENT_FLOATS).astype(dtype)]
        for _ in range(3):
            t.all_reduce(grads)
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            t.all_reduce(grads)
            seconds.append(time.perf_counter() - start)
        print(json.dumps({"mode": t.mode, "seconds": seconds}), flush=True)
    finally:
        t.close()


# A PowerSGD step's small all-reduces for the MLP at rank 4 (`_small_worker`), in floats:
# the P factors with the vectors sent whole, the Q factors, Keras' logged loss.
SMALL_ROUNDS = (4 * (784 + 1024 + 1024) + 1024 + 1024 + 10, 4 * (1024 + 1024 + 10), 1)
SMALL_STEPS = 300


def _small_worker(store: str, rank: int, host: str) -> None:
    """One of 2 workers: `SMALL_ROUNDS` in a traced step, one after the other as PowerSGD
    runs them; prints the wall and CPU seconds per step, and whether the op ran them."""
    import numpy as np
    import tensorflow as tf

    from tf_distrib import transport
    from tf_distrib.transport import graph_op

    t = transport.connect(rank, ["worker:0", "worker:1"], host, transport.FileStore(store),
                          secret=b"bench", mode="tcp", timeout=60)
    values = [tf.Variable(np.ones(n, np.float32)) for n in SMALL_ROUNDS]

    @tf.function
    def step():  # the transport runs a step's all-reduces in turn, as PowerSGD's
        return [graph_op.all_reduce(t, [value]) for value in values]

    try:
        for _ in range(30):
            step()
        cpu, wall = os.times(), time.perf_counter()
        for _ in range(SMALL_STEPS):
            step()
        wall, after = time.perf_counter() - wall, os.times()
        print(json.dumps({"wall": wall / SMALL_STEPS, "native": t.exchange is not None,
                          "cpu": (after.user + after.system - cpu.user - cpu.system)
                          / SMALL_STEPS}), flush=True)
    finally:
        t.close()


def _small_rows() -> list[dict]:
    """`_small_worker` on 2 hosts per link rate, by the native op and by the Python path
    (`TF_DISTRIB_NATIVE_SUM=0`) in turns; medians over `PASSES` of the slower worker."""
    from tf_distrib import contract
    from tf_distrib.testing import simulated_hosts

    print(f"PowerSGD's small all-reduces per step (MLP, rank 4: {SMALL_ROUNDS[0] * 4 / 1e3:.1f}"
          f" KB, {SMALL_ROUNDS[1] * 4 / 1e3:.1f} KB, 4 B), 2 hosts x 1 worker; medians of "
          f"{PASSES} passes of {SMALL_STEPS} steps")
    print(f"  {'link':>7} {'path':<12}{'wall ms':>9}{'CPU ms':>8}")
    rows = []
    for rate in RATES:
        passes: dict[str, list[dict]] = {"native op": [], "Python path": []}
        with simulated_hosts.SimulatedHosts(2, rate) as hosts:
            for _ in range(PASSES):
                for path, native in (("native op", "1"), ("Python path", "0")):
                    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                           contract.ENV_NATIVE_SUM: native}
                    passes[path].append(_run_small(hosts, env))
        for path, runs in passes.items():
            wall = statistics.median(r["wall"] for r in runs)
            cpu = statistics.median(r["cpu"] for r in runs)
            rows.append({"rate": rate, "path": path, "wall": wall, "cpu": cpu,
                         "native": all(r["native"] for r in runs)})
            print(f"  {rate:>7} {path:<12}{wall * 1e3:9.2f}{cpu * 1e3:8.2f}", flush=True)
        native, python = rows[-2], rows[-1]
        print(f"  {rate:>7} the op takes {native['wall'] / python['wall']:.2f}x the Python "
              f"path's wall time, {native['cpu'] / python['cpu']:.2f}x its CPU", flush=True)
    return rows


def _run_small(hosts, env: dict) -> dict:
    """One pass of `_small_worker`: the slower worker's wall time, its CPU time."""
    with tempfile.TemporaryDirectory(prefix="tf_distrib_bench_cluster_") as store:
        processes = [hosts.run(rank, [sys.executable, "-m", __name__, "small", store,
                                      str(rank), hosts.addresses[rank]], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for rank in range(2)]
        outputs = [p.communicate(timeout=300) for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError("a benchmark worker failed:\n" + "\n".join(e for _, e in outputs))
    return max((json.loads(out.strip().splitlines()[-1]) for out, _ in outputs),
               key=lambda r: r["wall"])


# `fit` across the hosts: the scaling benchmark's job (tf_distrib.bench.scaling), one
# worker per host pinned to its own core, against one worker alone on one core.
FIT_SETTINGS = {"TF collective": {"transport": "tf"}, "tf_distrib": {},
                "tf_distrib + bf16": {"compression": "bf16"},
                "tf_distrib + PowerSGD": {"compression": "powersgd"}}
# Measured epochs of each setting in turn with one worker (`_fit_turns`).
FIT_PAIRS = 5
POWERSGD_RANK = 4  # DDP's powerSGD_hook's, as tf_distrib's default
DDP_POWERSGD_TIMEOUT = 120.0
_PORT = 29400


def _turns_worker(settings_json: str, directory: str) -> None:
    """A worker of `_fit_turns`: one of the pair under `tf-distrib launch`, or the lone
    one (`TF_DISTRIB_WORKER_INDEX=2`); prints its per-epoch measurements as JSON."""
    from tf_distrib.bench import scaling

    result = scaling.train_worker(json.loads(settings_json),
                                  turns=scaling.Turns(directory, FIT_PAIRS, alone={}))
    print("turns=" + json.dumps(result), flush=True)


def _ddp_worker(rank: str, world: str, master: str, powersgd_rank: str) -> None:
    """One PyTorch process of the scaling job on a simulated host; prints its measurement."""
    from tf_distrib.bench import pytorch_ddp, scaling

    os.environ.update(TF_DISTRIB_WORKER_INDEX=rank, TF_DISTRIB_NUM_WORKERS=world,
                      GLOO_SOCKET_IFNAME="eth0")
    result = pytorch_ddp.train_worker(_PORT + 1, 60, scaling.PER_WORKER_BATCH, 1, "mlp", master,
                                      int(powersgd_rank) or None)
    print(f"examples_per_sec={result['examples_per_sec']}", flush=True)


def _ddp_rate(hosts, world: int, powersgd_rank: int = 0, timeout: float = 600.0) -> float:
    """Global examples/s of PyTorch DDP on the first `world` hosts, one process each
    (with its `powerSGD_hook` at `powersgd_rank`, unless 0); RuntimeError if a process
    fails or the run takes over `timeout` seconds."""
    processes = [hosts.run(i, [sys.executable, "-m", __name__, "ddp", str(i), str(world),
                               hosts.addresses[0], str(powersgd_rank)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True) for i in range(world)]
    deadline = time.monotonic() + timeout
    try:
        outputs = [p.communicate(timeout=max(0.0, deadline - time.monotonic()))[0]
                   for p in processes]
    except subprocess.TimeoutExpired:
        for p in processes:
            p.kill()
            p.communicate()
        raise RuntimeError(f"a PyTorch run hung: no end within {timeout:g} s") from None
    if any(p.returncode for p in processes):
        raise RuntimeError("a PyTorch run failed:\n" + "\n".join(o[-3000:] for o in outputs))
    return float(outputs[0].rsplit("examples_per_sec=", 1)[1].split()[0])


def _fit_turns(hosts, settings: dict) -> dict:
    """`fit` with `settings` on both hosts, an epoch at a time in turn with one worker
    alone on host 0 under `make_strategy()` (`scaling.Turns`).

    Returns:
        `scaling.in_turns`' figures for each of `FIT_PAIRS` measured epochs of the pair.
    """
    from tf_distrib.bench import scaling

    spec = ",".join(f"{address}:{_PORT}" for address in hosts.addresses)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with tempfile.TemporaryDirectory(prefix="tf_distrib_bench_turns_") as directory:
        job = ["-m", __name__, "turns", json.dumps(settings), directory]
        commands = [[sys.executable, "-m", "tf_distrib.launch", "-n", "1", "--hosts", spec,
                     "--host-index", str(i), "--timeout", "900", *job]
                    for i in range(len(hosts.addresses))]
        processes = [hosts.run(i, command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
                     for i, command in enumerate(commands)]
        processes.append(hosts.run(0, [sys.executable, *job], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True,
                                   env={**env, "TF_DISTRIB_WORKER_INDEX": "2",
                                        "TF_DISTRIB_NUM_WORKERS": "1"}))
        outputs = [p.communicate(timeout=1200)[0] for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError("a benchmark job failed:\n" + "\n".join(o[-3000:] for o in outputs))
    values = [json.loads(o.rsplit("turns=", 1)[1].splitlines()[0]) for o in outputs]
    return scaling.compare_turns(values, FIT_PAIRS, apart=False)


def _measure(hosts, per_host: int, mode: str, dtype_name: str) -> dict:
    world = len(hosts.addresses) * per_host
    with tempfile.TemporaryDirectory(prefix="tf_distrib_bench_cluster_") as store:
        processes = [hosts.run(rank // per_host, [
            sys.executable, "-m", __name__, "worker", store, str(rank), str(world),
            hosts.addresses[rank // per_host], mode, dtype_name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(world)]
        outputs = [p.communicate(timeout=300) for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError("a benchmark worker failed:\n" + "\n".join(e for _, e in outputs))
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    slowest = [max(r["seconds"][i] for r in results) for i in range(REPEATS)]
    return {"mode": results[0]["mode"], "seconds": statistics.median(slowest)}


def _link_bytes(buffer_bytes: int, hosts: int, per_host: int, mode: str) -> float:
    """Bytes one host sends over its link per all-reduce."""
    if mode == "shm+tcp":
        return 2 * (hosts - 1) / hosts * buffer_bytes
    world = hosts * per_host
    return 2 * (world - 1) / world * buffer_bytes


# A round of the ring: one float's all-reduce through the ring between two idle simulated
# hosts took 0.40 ms, two rounds (2026-12-02). Fitting it with the rest traded it for
# bandwidth (0 to 1.6 ms in different runs).
ROUND_SECONDS = 2.0e-4


def calibrate(rows: list[dict], cores: int) -> dict:
    """The cost model's constants from measured rows.

    An all-reduce of B bytes (E elements) over H hosts on links of R bytes/s takes

        t = S a + max(L / (e R), C) + (o - 1) max(0, C - L / (e R) / o),
        C = c T + d U + w W + s M

    A flat ring of N workers: S = 2(N-1) rounds of messages, L = 2(N-1)/N B sent over
    each host's link, T = L bytes sent (and received) by each worker's TCP, U = (N-1)/N E
    elements summed by each worker, M = 0. Hierarchical (P workers per host, P rings of
    H hosts): S = 2(H-1), L = 2(H-1)/H B, T = L / P, U = (H-1)/H E / P in the ring plus
    (P-1)/P E in the host's shared memory (each worker sums its 1/P of the P workers'
    gradients), and M = B bytes through the host's shared memory. W = U for 16-bit
    floats (summed in float32: the casts), else 0. C is a worker's CPU time, and it
    overlaps the link's: the kernel streams one chunk while the worker sums the last, so
    the slower of the two sets the pace. o, the processes per core (at least 1; 3 or 4
    simulated hosts share this machine's cores), makes a worker wait for the CPU time of
    those that share its core too, beyond their share of its link's time. a: seconds
    per round (a round trip and thread hand-offs: `ROUND_SECONDS`, measured apart), e:
    the share of the link's rate the TCP streams reach, c: CPU seconds per byte (copies,
    the kernel's TCP), d: per element summed, w: more per 16-bit element, s: per byte of
    shared memory. e by a grid, (c, d, w, s) by least squares on the relative error,
    none negative.

    Args:
        rows: Measured rows ("rate", "hosts", "per_host", "mode", "dtype", "bytes",
            "seconds").
        cores: The cores the simulated hosts shared.

    Raises:
        ValueError: no non-negative constants fit the rows; the message says what to do.
    """
    import numpy as np

    measured = np.array([r["seconds"] for r in rows])
    best = None
    for e in np.linspace(0.70, 1.15, 46):  # this VM's slow phases leave links 71% busy
        fit = _least_squares(rows, float(e), cores, measured)
        if fit is not None and (best is None or fit[0] < best[0]):
            best = fit
    if best is None:
        raise ValueError(
            f"The cost model has no fit with non-negative constants to these {len(rows)} "
            "rows (a slower run with less data than the time it takes?). Calibrate on "
            "every row of one `tf-distrib bench cluster` run.")
    return best[1]


_CONSTANTS = ("c", "d", "w", "s")
LAWSON_ITERATIONS = 50
# A row took its link's time (not its CPU's) if it took less than this times the link's.
LINK_BOUND = 1.1


def _least_squares(rows: list[dict], e: float, cores: int, measured
                   ) -> tuple[float, dict] | None:
    """(worst relative error, model) of the (c, d, w, s) for link share `e` that make the
    worst relative error least, none negative; None where every one would be.
    `calibrate`'s model is linear in them once each row's sides of its two max() are
    known: start with the rows that took about their link's time on the link's side and
    the rest on the CPU's, refit until no row changes side, and keep the fit of least
    worst error. Each fit is Lawson's: least squares reweighted by each row's error, which
    tends to the least worst error."""
    import numpy as np

    sides = []
    for row, seconds in zip(rows, measured, strict=True):
        _, link, rounds, _ = _terms(row, e, cores)
        sides.append((seconds - ROUND_SECONDS * rounds > LINK_BOUND * link, True))
    best = None
    for _ in range(len(rows) + 1):
        features, fixed = [], []
        for row, (busy_side, shared) in zip(rows, sides, strict=True):
            cpu, link, rounds, over = _terms(row, e, cores)
            factor = float(busy_side) + (over - 1) * shared
            features.append([factor * v for v in cpu])
            fixed.append(ROUND_SECONDS * rounds + link * (not busy_side)
                         - (over - 1) / over * link * shared)
        a = np.array(features) / measured[:, None]
        b = (measured - np.array(fixed)) / measured
        weights = np.full(len(rows), 1.0 / len(rows))
        for _ in range(LAWSON_ITERATIONS):
            root = np.sqrt(weights)[:, None]
            coefficients = _non_negative(a * root, b * root[:, 0])
            if coefficients is None:
                break
            errors = np.abs(a @ coefficients - b)
            if not errors.any():
                break
            weights = weights * errors / (weights * errors).sum()
        if coefficients is None:
            break
        constants = dict(zip(_CONSTANTS, (float(k) for k in coefficients), strict=True))
        model = {"a": ROUND_SECONDS, "e": e, **constants}
        worst = max(abs(predict(model, row, cores) / seconds - 1)
                    for row, seconds in zip(rows, measured, strict=True))
        if best is None or worst < best[0]:
            best = (worst, model)
        now = []
        for row in rows:
            cpu, link, _, over = _terms(row, e, cores)
            busy = _cpu_seconds(constants, cpu)
            now.append((busy >= link, busy > link / over))
        if now == sides:
            break
        sides = now
    return best


def _non_negative(a, b):
    """x >= 0 minimising |a x - b| (columns of negative weight dropped, most negative
    first), or None when none is left."""
    import numpy as np

    free = list(range(a.shape[1]))
    while free:
        x, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (x >= 0).all():
            if not x.any():
                return None
            out = np.zeros(a.shape[1])
            out[free] = x
            return out
        free.pop(int(np.argmin(x)))
    return None


def predict(model: dict, row: dict, cores: int | None = None) -> float:
    """Seconds of one all-reduce of `row` ("rate", "hosts", "per_host", "mode", "dtype",
    "bytes") by the model; `cores` shared by every process (None: each host its own)."""
    cpu, link, rounds, over = _terms(row, model["e"], cores)
    busy = _cpu_seconds(model, cpu)
    return model["a"] * rounds + max(link, busy) + (over - 1) * max(0.0, busy - link / over)


def _cpu_seconds(constants: dict, cpu: list[float]) -> float:
    """C of `calibrate`'s model: a worker's CPU time from its [T, U, W, M]."""
    return sum(constants[k] * v for k, v in zip(_CONSTANTS, cpu, strict=True))


def _terms(row: dict, e: float, cores: int | None) -> tuple[list[float], float, int, float]:
    """([T, U, W, M], L / (e R), S, o) of `calibrate`'s model for one row."""
    hosts, per_host, nbytes = row["hosts"], row["per_host"], row["bytes"]
    hierarchical = row["mode"] == "shm+tcp"
    ring, share = (hosts, per_host) if hierarchical else (hosts * per_host, 1)
    over = max(1.0, hosts * per_host / cores) if cores else 1.0
    elements = nbytes / DTYPES[row["dtype"]]
    rounds, sent, summed = _across(ring, nbytes / share, elements / share)
    sent *= share  # each host's P rings share its link
    if hierarchical:
        summed += (per_host - 1) / per_host * elements  # and in its host's shared memory
    narrow = summed if DTYPES[row["dtype"]] < 4 else 0.0
    return ([sent / share, summed, narrow, nbytes if hierarchical else 0.0],
            sent / (e * _BITS[row["rate"]] / 8), rounds, over)


def _across(workers: int, nbytes: float, elements: float) -> tuple[int, float, float]:
    """(rounds, bytes over the busiest link, elements summed by a worker) of the all-reduce
    over TCP that the transport picks (`ring.all_reduce`): the ring, or halving-doubling
    (with the ranks beyond the largest power of two P folded in: 2 more rounds, the whole
    buffer twice more over their links, and once more summed)."""
    if not halving_doubling.preferred(workers, nbytes):
        return 2 * (workers - 1), 2 * (workers - 1) / workers * nbytes, (
            (workers - 1) / workers * elements)
    power = 1 << (workers.bit_length() - 1)
    folded = 0 if power == workers else 1
    return (2 * (power.bit_length() - 1) + 2 * folded,
            (2 * (power - 1) / power + 2 * folded) * nbytes,
            ((power - 1) / power + folded) * elements)


# What the projection assumes of each model: gradient floats and compute seconds per step.
# The MLP's step is one worker's on this host (docs/performance.md); ResNet-50's (25.6M
# parameters) a GPU-class step of 0.2 s, where the network matters most.
PROJECTED_MODELS = {"MLP": (GRADIENT_FLOATS, 0.0066), "ResNet-50": (25_600_000, 0.2)}
PROJECTED_LINKS = {"10 Gbit/s": "10gbit", "25 Gbit/s": "25gbit", "100 Gbit/s": "100gbit"}
# PowerSGD at rank 4 (`PowerSGD.compresses`): the floats of its two all-reduces (the P
# factors with the gradients that travel whole, then the Q factors), counted on the MLP and
# on keras.applications.ResNet50's weights (62x fewer than its 25.6M), and the seconds of
# its arithmetic per gradient element beyond what an SGD step costs anyway: for the MLP
# 1.7 ms for 1.86M, between what the native ops add alone and in `fit` on this host's cores
# (docs/gradients.md), and for ResNet-50 its six passes over float32 less an SGD step's
# three, at a GPU's 2 TB/s.
POWERSGD_ROUNDS = {"MLP": ((784 + 1024 + 1024) * 4 + 2058, (1024 + 1024 + 10) * 4),
                   "ResNet-50": (300_404, 110_240)}
POWERSGD_SECONDS_PER_ELEMENT = {"MLP": 0.9e-9, "ResNet-50": 3 * 4 / 2e12}
PROJECTED_WORKERS = (2, 8, 64, 512)
PER_HOST = 8


def project(model: dict) -> list[dict]:
    """Scaling efficiency by the model (compute / (compute + all-reduce / K), no overlap)
    from 2 to 512 workers, each host with cores of its own: flat ring (1 worker per host)
    and hierarchical (8 per host), float32 and bfloat16, every step (K=1) or every 4th
    (accumulation, K=4)."""
    rows = []
    for name, (floats, compute) in PROJECTED_MODELS.items():
        for link, rate in PROJECTED_LINKS.items():
            for scheme, per_host in (("flat", 1), ("hierarchical", PER_HOST)):
                for dtype, itemsize in DTYPES.items():
                    for k in (1, 4):
                        efficiency = {}
                        for n in PROJECTED_WORKERS:
                            if n % per_host:
                                continue
                            seconds = predict(model, {
                                "rate": rate, "hosts": n // per_host, "per_host": per_host,
                                "mode": "shm+tcp" if per_host > 1 else "tcp",
                                "dtype": dtype, "bytes": floats * itemsize})
                            efficiency[n] = compute / (compute + seconds / k)
                        rows.append({"model": name, "link": link, "scheme": scheme,
                                     "dtype": dtype, "K": k, "efficiency": efficiency})
            rows += _project_powersgd(model, name, link, rate)
    return rows


def _project_powersgd(model: dict, name: str, link: str, rate: str) -> list[dict]:
    """`project`'s rows for PowerSGD at rank 4, every step: its two all-reduces (flat and
    hierarchical) and its arithmetic (`POWERSGD_SECONDS_PER_ELEMENT`)."""
    floats, compute = PROJECTED_MODELS[name]
    arithmetic = floats * POWERSGD_SECONDS_PER_ELEMENT[name]
    rows = []
    for scheme, per_host in (("flat", 1), ("hierarchical", PER_HOST)):
        efficiency = {}
        for n in PROJECTED_WORKERS:
            if n % per_host:
                continue
            seconds = arithmetic + sum(predict(model, {
                "rate": rate, "hosts": n // per_host, "per_host": per_host,
                "mode": "shm+tcp" if per_host > 1 else "tcp", "dtype": "float32",
                "bytes": round_floats * 4}) for round_floats in POWERSGD_ROUNDS[name])
            efficiency[n] = compute / (compute + seconds)
        rows.append({"model": name, "link": link, "scheme": scheme, "dtype": "PowerSGD4",
                     "K": 1, "efficiency": efficiency})
    return rows


def run(options) -> dict:
    from tf_distrib.testing import simulated_hosts

    why = simulated_hosts.unavailable()
    if why:
        print(f"skipped: needs {why}")
        return {"skipped": why}
    layouts = [(n, 1, "tcp") for n in HOST_COUNTS] + [(2, p, m) for p, m in LAYOUTS if p > 1]
    # This VM changes speed every few seconds to minutes: every row is measured once per
    # pass, so that the 2-host rows the model is fitted on and the 3- and 4-host rows it
    # predicts come from the same stretches of time.
    measured: dict[tuple, list[dict]] = {}
    for _ in range(PASSES):
        for rate in RATES:
            for n in sorted({n for n, _, _ in layouts}):
                with simulated_hosts.SimulatedHosts(n, rate) as hosts:
                    for per_host, mode in [(p, m) for h, p, m in layouts if h == n]:
                        for dtype_name in DTYPES:
                            measured.setdefault((rate, n, per_host, mode, dtype_name), []).append(
                                _measure(hosts, per_host, mode, dtype_name))
    print(f"{'link':>7} {'workers':>8} {'transport':>9} {'dtype':>9} {'ms':>8} {'link use':>9}")
    rows = [_row(rate, n, per_host, dtype_name, runs)
            for (rate, n, per_host, _, dtype_name), runs in measured.items()]
    model = _model(rows, len(os.sched_getaffinity(0)))
    small_rows = _small_rows()
    fit_rows = _fit_rows(rows)
    projection = project(model) if model is not None else []
    if projection:
        print("projected scaling efficiency (compute / step), workers: "
              + " ".join(f"{n:>6}" for n in PROJECTED_WORKERS))
        for p in projection:
            cells = " ".join(f"{p['efficiency'][n]:6.0%}" if n in p["efficiency"]
                             else f"{'-':>6}" for n in PROJECTED_WORKERS)
            print(f"  {p['model']:<9} {p['link']:<10} {p['scheme']:<12} {p['dtype']:<9} "
                  f"K={p['K']}: {cells}")
    return {"gradient_floats": GRADIENT_FLOATS, "repeats": REPEATS, "rows": rows,
            "model": model, "projection": projection, "small": small_rows, "fit": fit_rows}


def _model(rows: list[dict], cores: int) -> dict | None:
    """The cost model calibrated on every row, each row given its prediction, and how
    well the 2-host rows alone predict the others; or None, said why, when no constants
    fit (a pass that this VM slowed down can make more bytes take less time): the
    measured rows and the `fit` rows still stand."""
    try:
        model = calibrate(rows, cores)
    except ValueError as e:
        print(f"cost model: not fitted, so no predictions or projections: {e}")
        return None
    print(f"cost model from every row: a = {model['a'] * 1e6:.0f} us per round, "
          f"e = {model['e']:.0%} of the link, c = {model['c'] * 1e9:.2f} ns/byte, "
          f"d = {model['d'] * 1e9:.2f} ns/element (16-bit: {model['w'] * 1e9:+.2f}) of CPU, "
          f"shared memory {model['s'] * 1e9:.2f} ns/byte")
    two = [r for r in rows if r["hosts"] == 2]
    others = [r for r in rows if r["hosts"] != 2]
    try:
        from_two = calibrate(two, cores) if others else None
    except ValueError:
        from_two = None
    for r in rows:
        r["predicted_seconds"] = predict(model, r, cores)
        print(f"  {r['rate']:>7} {r['hosts']}x{r['per_host']} {r['mode']:>8} {r['dtype']:>9}: "
              f"measured {r['seconds'] * 1e3:6.1f} ms, predicted "
              f"{r['predicted_seconds'] * 1e3:6.1f} ms "
              f"({r['predicted_seconds'] / r['seconds'] - 1:+.0%})")
    if from_two is not None:
        errors = [predict(from_two, r, cores) / r["seconds"] - 1 for r in others]
        model["held_out_worst"] = max(errors, key=abs)
        print(f"calibrated on the 2-host rows alone, it predicts the {len(others)} others "
              f"within {abs(model['held_out_worst']):.0%}")
    return model


def _fit_rows(rows: list[dict]) -> list[dict]:
    """`fit` on 2 hosts x 1 worker per link rate and setting, scaling and overlap.

    Each tf.distribute setting trains an epoch at a time in turn with one worker alone
    (`_fit_turns`, as `bench scaling`'s rows in turns): its scaling is the median over
    `FIT_PAIRS` epochs of the pair's rate over the lone worker's in the epochs around it,
    seconds apart, so that the VM's changes of speed cancel out. PyTorch, which has no
    turns, runs one process and DDP back to back `PASSES` times: the median of their
    ratios.
    """
    from tf_distrib.bench import pytorch_ddp, scaling
    from tf_distrib.testing import simulated_hosts

    print(f"fit, MLP 784-1024-1024-10, {scaling.PER_WORKER_BATCH} examples per worker per "
          "step, 2 hosts x 1 worker (one core each) against 1 worker on one core; "
          f"tf.distribute: medians of {FIT_PAIRS} epochs in turn with one worker "
          f"(make_strategy()), PyTorch: of {PASSES} paired passes")
    print(f"  {'link':>7} {'setting':<20}{'examples/s':>11}{'scaling':>9}{'hidden':>8}   "
          "(one worker)")
    fit_rows = []
    for rate in RATES:
        with simulated_hosts.SimulatedHosts(2, rate) as hosts:
            # setting -> its and one worker's examples/s, and its scaling, per pair
            measured = {name: _fit_turns(hosts, settings)
                        for name, settings in FIT_SETTINGS.items()}
            if pytorch_ddp.available():
                _ddp_powersgd(hosts, rate)
                alone, pair = zip(*[(_ddp_rate(hosts, 1), _ddp_rate(hosts, 2))
                                    for _ in range(PASSES)], strict=True)
                measured["PyTorch DDP (gloo)"] = {
                    "examples_per_sec": pair, "one_worker_examples_per_sec": alone,
                    "scaling": [p / a for p, a in zip(pair, alone, strict=True)]}
        for name, runs in measured.items():
            examples = statistics.median(runs["examples_per_sec"])
            ratio = statistics.median(runs["scaling"])
            one = statistics.median(runs["one_worker_examples_per_sec"])
            # How much of the all-reduce hid behind computation: step time against one
            # worker's step plus the transport's all-reduce alone (its row).
            settings, hidden = FIT_SETTINGS.get(name), None  # settings None: PyTorch's
            if (settings is not None and settings.get("transport") != "tf"
                    and settings.get("compression") != "powersgd"):
                dtype = "bfloat16" if settings.get("compression") else "float32"
                alone = next(r["seconds"] for r in rows if r["rate"] == rate and
                             r["hosts"] == 2 and r["per_host"] == 1 and r["dtype"] == dtype)
                step = 2 * scaling.PER_WORKER_BATCH / examples
                compute = scaling.PER_WORKER_BATCH / one
                hidden = max(0.0, (compute + alone - step) / alone)
            fit_rows.append({"rate": rate, "setting": name, "examples_per_sec": examples,
                             "scaling": ratio, "one_worker": one, "hidden": hidden,
                             "examples_per_sec_per_pair": list(runs["examples_per_sec"]),
                             "one_worker_per_pair": list(runs["one_worker_examples_per_sec"])})
            print(f"  {rate:>7} {name:<20}{examples:>11.0f}{ratio:>8.2f}x"
                  + (f"{hidden:>8.0%}" if hidden is not None else f"{'':>8}")
                  + f"   ({one:.0f}{'' if settings is not None else ', 1 PyTorch process'})",
                  flush=True)
    if not pytorch_ddp.available():
        print("  (PyTorch DDP rows: torch is not installed)")
    return fit_rows


def _ddp_powersgd(hosts, rate: str) -> None:
    """Tries DDP's `powerSGD_hook` once: on gloo (CPU) it aborts (pytorch#58467), or
    hangs (a DDP run of the benchmark takes 10-20 s)."""
    try:
        rate_seen = _ddp_rate(hosts, 2, POWERSGD_RANK, timeout=DDP_POWERSGD_TIMEOUT)
    except RuntimeError as e:
        cause = next((line.strip() for line in str(e).splitlines()
                      if "what()" in line or "hung" in line), "it failed")
        print(f"  {rate:>7} PyTorch DDP + powerSGD_hook (rank {POWERSGD_RANK}): fails: "
              f"{cause[:120]}", flush=True)
    else:
        print(f"  {rate:>7} PyTorch DDP + powerSGD_hook (rank {POWERSGD_RANK}): "
              f"{rate_seen:.0f} examples/s (one pass)", flush=True)


def _row(rate, n, per_host, dtype_name, runs: list[dict]) -> dict:
    """One printed row: the median over passes of `_measure`'s results `runs`."""
    mode, seconds = runs[0]["mode"], statistics.median(r["seconds"] for r in runs)
    buffer_bytes = GRADIENT_FLOATS * DTYPES[dtype_name]
    use = _link_bytes(buffer_bytes, n, per_host, mode) * 8 / seconds / _BITS[rate]
    print(f"{rate:>7} {f'{n}x{per_host}':>8} {mode:>9} {dtype_name:>9} "
          f"{seconds * 1e3:8.1f} {use:9.0%}", flush=True)
    return {"rate": rate, "hosts": n, "per_host": per_host, "mode": mode,
            "dtype": dtype_name, "bytes": buffer_bytes, "seconds": seconds,
            "seconds_per_pass": [r["seconds"] for r in runs], "link_use": use}


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        store, rank, world, host, mode, dtype_name = sys.argv[2:]
        _worker(store, int(rank), int(world), host, mode, dtype_name)
    elif sys.argv[1:2] == ["small"]:
        store, rank, host = sys.argv[2:]
        _small_worker(store, int(rank), host)
    elif sys.argv[1:2] == ["turns"]:
        _turns_worker(*sys.argv[2:4])
    elif sys.argv[1:2] == ["ddp"]:
        _ddp_worker(*sys.argv[2:6])
    else:
        print(json.dumps(run(None)))
    sys.exit(os.EX_OK)
