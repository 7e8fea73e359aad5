"""The transport's all-reduce across simulated hosts on shaped links: flat ring and hierarchical.

2 simulated hosts (`tf_distrib.simulated_hosts`: network namespaces joined through a
bridge, each host's link shaped with tc tbf) at 1 and 10 Gbit/s; 1 or 2 workers per
host; the benchmark MLP's gradient (784-1024-1024-10: 1.86M floats, 7.4 MB of float32,
and its bfloat16 half). Each worker all-reduces it `REPEATS` times after a warm-up; the
row is the median over repeats of the slowest worker. "link" is the bytes each host
sends over its link per all-reduce (a flat ring of N workers: 2(N-1)/N of the buffer on
the one ring edge that leaves the host; hierarchical over H hosts: 2(H-1)/H of it, spread
over the host's L rings) divided by the time and the link rate: 100% is a link kept busy.
With 2 workers per host on this 2-core machine, the 4 workers share 2 cores.
Needs root (`SimulatedHosts`); skipped, naming what is missing, without it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RATES = {"1gbit": 1e9, "10gbit": 10e9}
GRADIENT_FLOATS = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
REPEATS = 20
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


def run(options) -> dict:
    from tf_distrib import simulated_hosts

    why = simulated_hosts.unavailable()
    if why:
        print(f"skipped: needs {why}")
        return {"skipped": why}
    rows = []
    print(f"{'link':>7} {'workers':>8} {'transport':>9} {'dtype':>9} {'ms':>8} {'link use':>9}")
    for rate, bits in RATES.items():
        with simulated_hosts.SimulatedHosts(2, rate) as hosts:
            for per_host, mode in LAYOUTS:
                for dtype_name, itemsize in (("float32", 4), ("bfloat16", 2)):
                    got = _measure(hosts, per_host, mode, dtype_name)
                    sent = _link_bytes(GRADIENT_FLOATS * itemsize, 2, per_host, got["mode"])
                    use = sent * 8 / got["seconds"] / bits
                    rows.append({"rate": rate, "workers": f"2x{per_host}", "mode": got["mode"],
                                 "dtype": dtype_name, "seconds": got["seconds"],
                                 "link_use": use})
                    print(f"{rate:>7} {'2x' + str(per_host):>8} {got['mode']:>9} "
                          f"{dtype_name:>9} {got['seconds'] * 1e3:8.1f} {use:9.0%}", flush=True)
    return {"gradient_floats": GRADIENT_FLOATS, "repeats": REPEATS, "rows": rows}


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        store, rank, world, host, mode, dtype_name = sys.argv[2:]
        _worker(store, int(rank), int(world), host, mode, dtype_name)
    else:
        print(json.dumps(run(None)))
    sys.exit(os.EX_OK)
