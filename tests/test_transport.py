"""tf_distrib's transport in real worker processes: sums, failures, authentication, fuzzing."""

import dataclasses
import hashlib
import os
import random
import socket
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

from tests import _stranger
from tf_distrib import transport
from tf_distrib.testing import run_workers
from tf_distrib.transport import halving_doubling, wire
from tf_distrib.transport.buffers import BufferPool, Layout
from tf_distrib.transport.connection import Connection
from tf_distrib.transport.errors import Peer

pytestmark = pytest.mark.multiprocess

DTYPES = {"float32": np.float32, "float16": np.float16}
SMALL = [1, 3]


def connect_pair(rank, directory, mode):
    """Worker `rank`'s transport of a job of two workers on this host."""
    return transport.connect(rank, ["worker:0", "worker:1"], "127.0.0.1",
                             transport.FileStore(directory), secret=b"s", mode=mode, timeout=30)


def _inputs(rank, sizes, dtype_name):
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    rng = np.random.default_rng(rank)
    return [(rng.standard_normal(n) * 4).astype(dtype) for n in sizes]


def sum_on_workers(directory, mode, sizes, dtype_name, repeats=2, secret=b"job secret",
                   hosts=None, polled=True):
    """Runs in each worker: all-reduces the same buckets `repeats` times.

    `hosts[rank]` puts the worker on a pretend host of that number: its shared-memory
    segment lives in a directory of another file system than /dev/shm, so that its host
    id differs (the real thing across hosts: tests/test_multi_host.py). `polled=False`
    makes the worker's shared memory work as off x86-64, without polled counters.
    """
    if not polled:
        from tf_distrib.transport import shared_memory

        shared_memory._ORDERED_STORES = False
    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    world = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    shm_directory = "/dev/shm"
    if hosts and hosts[rank]:
        shm_directory = os.path.join(directory, f"host{hosts[rank]}")
        os.makedirs(shm_directory, exist_ok=True)
    t = transport.connect(rank, [f"worker:{r}" for r in range(world)], "127.0.0.1",
                          transport.FileStore(directory), secret=secret, mode=mode, timeout=30,
                          shm_directory=shm_directory)
    try:
        arrays = _inputs(rank, sizes, dtype_name)
        for _ in range(repeats):
            result = [np.array(r) for r in t.all_reduce(arrays)]
        stats = dataclasses.replace(t.stats)
        # A bucket of a few values (the ring's exchange across hosts).
        small = [np.array(r) for r in t.all_reduce(_inputs(rank, SMALL, dtype_name))]
        return {"mode": t.mode, "sums": result, "stats": stats, "small": small}
    finally:
        t.close()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode, polled", [("shm", True), ("tcp", True), ("shm", False)],
                         ids=["shm", "tcp", "shm-unpolled"])
def test_sums_are_exact_and_bitwise_identical(tmp_path, mode, polled, world):
    # Bucket sizes from 1 element up; lengths that do not divide by the worker count.
    sizes = [1, 7, 1000, 65_537]
    workers = run_workers(sum_on_workers, world, args=(str(tmp_path), mode, sizes, "float32"),
                          kwargs={"polled": polled}, startup_timeout=None, quiet=True,
                          timeout=120)
    inputs = [_inputs(r, sizes, "float32") for r in range(world)]
    for w in workers:
        assert w.value["mode"] == mode
        assert w.value["stats"].collectives == 2
        assert (w.value["stats"].in_place > 0) == (mode == "shm" and polled)
        for k, got in enumerate(w.value["sums"]):
            reference = sum(x[k].astype(np.float64) for x in inputs)
            np.testing.assert_allclose(got, reference, rtol=1e-6, atol=1e-5 * world)
            assert got.dtype == np.float32 and got.shape == (sizes[k],)
    digests = {hashlib.sha256(b"".join(s.tobytes() for s in w.value["sums"] + w.value["small"]))
               .hexdigest() for w in workers}
    assert len(digests) == 1
    small = [_inputs(r, SMALL, "float32") for r in range(world)]
    for k, got in enumerate(workers[0].value["small"]):
        np.testing.assert_allclose(got, sum(x[k].astype(np.float64) for x in small), rtol=1e-6)


@pytest.mark.parametrize("world", [5, 8])
def test_halving_doubling_and_the_ring_sum_exactly_on_many_workers(tmp_path, world):
    # 5 workers: halving-doubling with rank 4 folded into rank 0 for the middle size, the
    # ring for the largest; 8: halving-doubling for both.
    sizes = [1000, 30_001, 1_000_000]
    assert halving_doubling.preferred(world, 30_001 * 4)
    assert halving_doubling.preferred(world, 4_000_000) == (world == 8)
    workers = run_workers(sum_on_workers, world, args=(str(tmp_path), "tcp", sizes, "float32"),
                          kwargs={"repeats": 1}, startup_timeout=None, quiet=True, timeout=180)
    inputs = [_inputs(r, sizes, "float32") for r in range(world)]
    for k, got in enumerate(workers[0].value["sums"]):
        reference = sum(x[k].astype(np.float64) for x in inputs)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-4 * world)
    assert len({hashlib.sha256(b"".join(s.tobytes() for s in w.value["sums"])).hexdigest()
                for w in workers}) == 1


def test_halving_doubling_is_chosen_where_its_rounds_save_more_than_its_bytes_cost():
    assert not any(halving_doubling.preferred(n, 1 << 20) for n in (2, 3))
    # 4 workers: 2 rounds fewer, worth 1 MB at 10% more per byte, not 1 GB.
    assert halving_doubling.preferred(4, 1 << 20) and not halving_doubling.preferred(4, 1 << 30)
    assert halving_doubling.preferred(512, 1 << 30)  # 18 rounds instead of 1022
    assert halving_doubling.preferred(6, 100_000) and not halving_doubling.preferred(6, 1 << 24)
    assert halving_doubling.preferred(513, 1 << 24)  # 20 rounds + 2 buffers for 1024 rounds


def hold_results(directory, collectives):
    """Runs in each worker: worker 1 keeps every result, worker 0 none; then both drop them."""
    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    t = connect_pair(rank, directory, "shm")
    try:
        held, copies = [], []
        for k in range(collectives):
            [result] = t.all_reduce([np.full(100_000, rank + k, np.float32)])
            copies.append(result.copy())
            if k == 0:  # in shared memory: every worker reads it
                with pytest.raises(ValueError, match="read-only"):
                    result[0] = 0.0
            if rank == 1:
                held.append(result)
        while_held = t.stats.in_place
        # What worker 1 kept is what it was given, though later sums were made meanwhile.
        intact = all(np.array_equal(h, c) for h, c in zip(held, copies, strict=False))
        held.clear()
        t.all_reduce([np.ones(100_000, np.float32)])
        return {"in_place": [while_held, t.stats.in_place], "intact": intact,
                "sums": [float(c[0]) for c in copies]}
    finally:
        t.close()


def test_sums_stay_in_shared_memory_until_a_worker_holds_every_region(tmp_path):
    from tf_distrib.transport.shared_memory import RESULT_REGIONS

    collectives = RESULT_REGIONS + 2
    workers = run_workers(hold_results, 2, args=(str(tmp_path), collectives),
                          startup_timeout=None, quiet=True, timeout=120)
    for w in workers:
        assert w.value["sums"] == [2.0 * k + 1 for k in range(collectives)]
        assert w.value["intact"]
        # The first RESULT_REGIONS sums stay in shared memory; worker 1 still holds them
        # when the next two come, so both workers copy those two out; once it lets go,
        # shared memory again.
        assert w.value["in_place"] == [RESULT_REGIONS, RESULT_REGIONS + 1]


def _counting(rank, n):
    """Worker `rank`'s addend of `n` elements: small integers, so every sum is exact, with
    a period (1009) that no chunk or part boundary shares."""
    return np.resize(np.arange(1009, dtype=np.float32) * (rank + 1) + rank, n)


def sum_larger_than_a_slot(directory):
    """Runs in each worker: layouts of one slot and a few elements up to more than every
    result region; then worker 1 holds a sum of 3 slots while both sum one of 2.

    Returns, for each sum, whether it stayed in shared memory, whether it is exact and
    its digest (the sums are too large to send back).
    """
    from tf_distrib.transport.shared_memory import RESULT_REGIONS

    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    t = connect_pair(rank, directory, "shm")
    sums = []

    def all_reduce(n):
        before = t.stats.in_place
        [result] = t.all_reduce([_counting(rank, n)])
        sums.append({"in_place": t.stats.in_place - before,
                     "read_only": not result.flags.writeable,
                     "exact": np.array_equal(result, np.resize(_counting(0, 1009)
                                                               + _counting(1, 1009), n)),
                     "digest": hashlib.sha256(result).hexdigest()})
        return result

    try:
        slot = t.in_place_bytes // 4  # float32s per slot
        for n in (slot + 17, 3 * slot - 5, RESULT_REGIONS * slot, RESULT_REGIONS * slot + 1):
            all_reduce(n)
        held = all_reduce(3 * slot)  # regions 0-2
        kept = held.copy()
        if rank == 0:
            del held
        all_reduce(2 * slot)  # regions 0-1: worker 1 holds them
        return {"sums": sums, "intact": rank == 0 or np.array_equal(held, kept)}
    finally:
        t.close()


def test_a_gradient_larger_than_a_slot_is_summed_in_place_across_regions(tmp_path):
    workers = run_workers(sum_larger_than_a_slot, 2, args=(str(tmp_path),),
                          startup_timeout=None, quiet=True, timeout=120)
    for w in workers:
        # Up to RESULT_REGIONS slots in shared memory; more, or a region that a worker
        # still holds, in private buffers.
        assert [s["in_place"] for s in w.value["sums"]] == [1, 1, 1, 0, 1, 0]
        assert [s["read_only"] for s in w.value["sums"]] == [True, True, True, False, True,
                                                             False]
        assert all(s["exact"] for s in w.value["sums"])
        assert w.value["intact"]
    assert ([s["digest"] for s in workers[0].value["sums"]]
            == [s["digest"] for s in workers[1].value["sums"]])


def default_buckets_fit_in_place(directory):
    import tensorflow as tf

    from tf_distrib.cross_device.bucketing import plan_buckets
    from tf_distrib.cross_device.gradients import GradientAllReduce
    from tf_distrib.transport.buffers import ALIGN

    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    t = connect_pair(rank, directory, "shm")
    try:
        limit = t.in_place_bytes
        bucket_bytes = GradientAllReduce(transport=t).bucket_bytes
        # limit bytes together, but limit + 64 once the first is padded to a 64-byte line.
        gradients = [np.ones(limit // 8 - 1, np.float32), np.ones(limit // 8 + 1, np.float32)]
        plan = plan_buckets([tf.TensorSpec(g.shape, tf.float32) for g in gradients],
                            bucket_bytes, align=ALIGN)
        for members in plan:
            t.all_reduce([gradients[k] for k in members])
        return {"limit": limit, "default": bucket_bytes, "buckets": len(plan),
                "in_place": t.stats.in_place,
                "given": GradientAllReduce(bucket_bytes=64 << 20, transport=t).bucket_bytes}
    finally:
        t.close()


def test_default_gradient_buckets_are_no_larger_than_the_transport_sums_in_place(tmp_path):
    from tf_distrib.cross_device.bucketing import DEFAULT_BUCKET_BYTES

    workers = run_workers(default_buckets_fit_in_place, 2, args=(str(tmp_path),),
                          startup_timeout=None, quiet=True, timeout=120)
    for w in workers:
        assert w.value["default"] == min(DEFAULT_BUCKET_BYTES, w.value["limit"])
        assert w.value["buckets"] == w.value["in_place"] == 2
        assert w.value["given"] == 64 << 20  # a size the user gives is the only limit


@pytest.mark.parametrize("hosts, mode", [([0, 0, 1, 1], "shm+tcp"), ([0, 0, 0, 1, 1, 1], "shm+tcp"),
                                         ([0, 0, 1], "tcp")], ids=["2x2", "2x3", "2+1"])
def test_hosts_with_several_workers_sum_hierarchically_exactly_and_identically(
        tmp_path, hosts, mode):
    _sum_hierarchically(tmp_path, hosts, mode)


def test_hosts_with_different_shared_memory_sum_in_slots_of_the_smallest(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a 32 MB tmpfs as one pretend host's /dev/shm")
    small = tmp_path / "host1"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(small)], check=True)
    try:
        # Slots of 1 MiB there, so on both hosts (16 MiB in /dev/shm alone): the 2.8 MB
        # sum takes three on each, whose parts the hosts' workers ring-reduce alike.
        _sum_hierarchically(tmp_path, [0, 0, 1, 1], "shm+tcp")
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_hosts_without_polled_counters_sum_hierarchically_exactly(tmp_path):
    # Off x86-64: each worker sums the host's gradients in full, rings its slice across
    # hosts, and gathers the others' slices; nothing is summed in place.
    workers = _sum_hierarchically(tmp_path, [0, 0, 1, 1], "shm+tcp", polled=False)
    assert all(w.value["stats"].in_place == 0 for w in workers)


def _sum_hierarchically(tmp_path, hosts, mode, polled=True):
    # Chunks of 1 element to several shared-memory slots (frames and polled counters).
    sizes = [1, 7, 65_537, 700_000]
    world = len(hosts)
    workers = run_workers(sum_on_workers, world, args=(str(tmp_path), "auto", sizes, "float32"),
                          kwargs={"hosts": hosts, "polled": polled}, startup_timeout=None,
                          quiet=True, timeout=120)
    inputs = [_inputs(r, sizes, "float32") for r in range(world)]
    for w in workers:
        assert w.value["mode"] == mode
        for k, got in enumerate(w.value["sums"]):
            reference = sum(x[k].astype(np.float64) for x in inputs)
            np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5 * world)
    digests = {hashlib.sha256(b"".join(s.tobytes() for s in w.value["sums"])).hexdigest()
               for w in workers}
    assert len(digests) == 1
    return workers


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_16_bit_sums_stay_within_one_rounding_per_hop(tmp_path, mode, dtype_name):
    world, sizes = 3, [5, 40_001]
    workers = run_workers(sum_on_workers, world, args=(str(tmp_path), mode, sizes, dtype_name),
                          startup_timeout=None, quiet=True, timeout=120)
    inputs = [_inputs(r, sizes, dtype_name) for r in range(world)]
    relative = 2.0 ** -8 if dtype_name == "bfloat16" else 2.0 ** -11
    for w in workers:
        for k, got in enumerate(w.value["sums"]):
            reference = sum(x[k].astype(np.float64) for x in inputs)
            magnitude = sum(np.abs(x[k].astype(np.float64)) for x in inputs)
            # shm rounds once; the ring rounds each of its N-1 partial sums.
            bound = relative * (1 if mode == "shm" else world - 1) * magnitude
            assert np.all(np.abs(got.astype(np.float64) - reference) <= bound)
    assert len({b"".join(s.tobytes() for s in w.value["sums"]) for w in workers}) == 1


def strategy_reductions():
    import tensorflow as tf

    import tf_distrib as td

    strategy = td.make_strategy()
    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    value = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant(rank + 1.0) / 3.0)  # not exact in binary: a real reduction
    return {"mode": strategy.transport.mode,
            "sum": float(strategy.reduce("SUM", value, axis=None)),
            "mean": float(strategy.reduce("MEAN", value, axis=None))}


def test_strategy_sum_and_mean_of_scalars_go_through_the_transport():
    workers = run_workers(strategy_reductions, 3, quiet=True)
    values = [np.float32(np.float32(r + 1.0) / np.float32(3.0)) for r in range(3)]
    for w in workers:
        assert w.value["mode"] == "shm"
        assert w.value["sum"] == pytest.approx(sum(float(v) for v in values), rel=1e-6)
        assert w.value["mean"] == pytest.approx(sum(float(v) for v in values) / 3, rel=1e-6)
    assert len({(w.value["sum"], w.value["mean"]) for w in workers}) == 1


def late_peer(directory):
    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    t = connect_pair(rank, directory, "tcp")
    if rank == 1:
        time.sleep(5)  # busy elsewhere: worker 0's 40 MB fill every socket buffer meanwhile
    began = time.monotonic()
    seq = t.start([np.full(20_000_000, rank + 1.0, np.float32)])
    started = time.monotonic() - began
    [total] = t.finish(seq)
    t.close()
    return float(total[0]), float(total[-1]), started


def test_a_late_peer_is_waited_for_while_the_buffers_are_full(tmp_path):
    workers = run_workers(late_peer, 2, args=(str(tmp_path),), startup_timeout=None,
                          quiet=True)
    assert [w.value[:2] for w in workers] == [(3.0, 3.0), (3.0, 3.0)]
    # Across hosts a collective runs on the transport's thread: `start` returns after its
    # copy of the 80 MB (up to a second on a loaded 2-core VM), not after the peer's 5 s.
    assert workers[0].value[2] < 2.5, workers[0].value


def test_a_worker_that_cannot_listen_makes_every_worker_fall_back(tmp_path):
    def connect(directory):
        rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
        host = "127.0.0.1" if rank == 0 else "192.0.2.1"  # TEST-NET: not on this host
        try:
            transport.connect(rank, ["worker:0", "worker:1"], host,
                              transport.FileStore(directory), secret=b"s", timeout=20)
        except transport.TransportUnavailable as e:
            return str(e)

    messages = [w.value for w in run_workers(connect, 2, args=(str(tmp_path),),
                                             startup_timeout=None, quiet=True)]
    assert all("worker:1 cannot listen on its TF_CONFIG host '192.0.2.1'" in m
               for m in messages)


def lose_a_peer(directory, how, peer_timeout, mode="tcp", elements=3_000_000):
    """Worker 1 dies (SIGKILL) or freezes (SIGSTOP) between two collectives."""
    import contextlib
    import signal

    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    world = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the survivors report
    t = transport.connect(rank, [f"worker:{r}" for r in range(world)], "127.0.0.1",
                          transport.FileStore(directory), secret=b"s", mode=mode,
                          peer_timeout=peer_timeout, timeout=30)
    data = [np.ones(elements, np.float32)]
    t.all_reduce(data)
    if rank == 1:
        with open(os.path.join(directory, "pid"), "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), getattr(signal, how))
    start = time.monotonic()
    try:
        t.all_reduce(data)
    except transport.PeerLostError as e:
        lost = {"seconds": time.monotonic() - start, "error": str(e)}
    open(os.path.join(directory, f"reported-{rank}"), "w").close()
    if rank == 0:  # a stopped worker would otherwise wait for the launcher's timeout
        # Not before every survivor has noticed on its own: one still waiting would see the
        # killed worker's connection close instead of its silence.
        survivors = [os.path.join(directory, f"reported-{r}") for r in range(world) if r != 1]
        for _ in range(200):
            if all(os.path.exists(s) for s in survivors):
                break
            time.sleep(0.05)
        with open(os.path.join(directory, "pid")) as f, contextlib.suppress(ProcessLookupError):
            os.kill(int(f.read()), signal.SIGKILL)
    return lost


# Over TCP the survivors wait for frames; on shared memory they poll counters (a small
# bucket summed in full, or a large one reduce-scattered in place).
@pytest.mark.parametrize("mode, elements", [("tcp", 3_000_000), ("shm", 16), ("shm", 100_000)])
@pytest.mark.parametrize("how, limit", [("SIGKILL", 2.0), ("SIGSTOP", 3.0 + 2.5)])
def test_a_lost_peer_fails_every_survivor_in_bounded_time_naming_it(tmp_path, how, limit, mode,
                                                                   elements):
    from tf_distrib.launch import launch

    result = launch(lose_a_peer, 3, args=(str(tmp_path), how, 3.0, mode, elements),
                    startup_timeout=None, quiet=True, timeout=60, grace_period=30)
    assert result.exit_codes == [[0, -9, 0]]
    for survivor in (result.workers[0], result.workers[2]):
        lost = survivor.value
        assert lost["seconds"] < limit, lost
        # Every survivor names worker 1, whether it noticed first or was told by a peer.
        assert "worker:1 (127.0.0.1:" in lost["error"], lost
        if how == "SIGSTOP":
            assert "sent nothing for" in lost["error"]


def sum_different_sizes(directory, sizes):
    """Each worker sums an array of its own size: the workers disagree."""
    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    t = connect_pair(rank, directory, "shm")
    t.all_reduce([np.ones(3, np.float32)])  # agreed: the counters move past a first chunk
    try:
        t.all_reduce([np.ones(sizes[rank], np.float32)])
    except transport.TransportError as e:
        return str(e)
    finally:
        t.close()


# Both sum in full; one sums in full while the other reduce-scatters in place.
@pytest.mark.parametrize("sizes", [(4, 40), (4, 100_000)])
def test_workers_that_sum_different_buckets_fail_instead_of_summing(tmp_path, sizes):
    messages = [w.value for w in run_workers(sum_different_sizes, 2,
                                             args=(str(tmp_path), sizes),
                                             startup_timeout=None, quiet=True, timeout=60)]
    assert all(m is not None for m in messages), messages
    assert any("the workers run different models, bucket sizes or code" in m
               for m in messages), messages


def test_wrong_secret_is_refused_and_logged(tmp_path):
    def connect(directory):
        import logging

        logging.basicConfig(level=logging.WARNING)
        rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
        try:
            transport.connect(rank, ["worker:0", "worker:1"], "127.0.0.1",
                              transport.FileStore(directory),
                              secret=b"right" if rank == 0 else b"wrong", timeout=5)
        except transport.TransportError as e:
            return type(e).__name__, str(e)

    workers = run_workers(connect, 2, args=(str(tmp_path),), startup_timeout=None, quiet=True)
    (kind0, message0), (kind1, message1) = (w.value for w in workers)
    assert kind1 == "AuthenticationError" and "could not prove" in message1
    assert kind0 == "TransportError" and "no authenticated connection from worker:1" in message0
    assert "refused a connection: a connection from 127.0.0.1" in "".join(workers[0].output)


def test_a_stranger_sending_garbage_is_refused_and_the_mesh_still_forms(tmp_path):
    def connect(directory):
        rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
        store = transport.FileStore(directory)
        if rank == 1:  # the stranger's connections queue up at worker 0 before this one's
            store.get(_stranger.SENT, 60)
        t = transport.connect(rank, ["worker:0", "worker:1"], "127.0.0.1", store, secret=b"s",
                              timeout=60)
        [total] = t.all_reduce([np.full(10, rank + 1.0, np.float32)])
        t.close()
        return float(total[0])

    replies = []
    stranger = threading.Thread(target=lambda: replies.extend(
        _stranger.send_garbage(transport.FileStore(str(tmp_path)))))
    stranger.start()
    workers = run_workers(connect, 2, args=(str(tmp_path),), startup_timeout=None, quiet=True)
    stranger.join()
    assert len(replies) == 2 and all(r in (b"", None) for r in replies)  # closed without a word
    assert [w.value for w in workers] == [3.0, 3.0]
    log = "".join(workers[0].output)
    assert log.count("refused a connection: a connection from 127.0.0.1") == 2
    assert "claims rank" in log and "not tf_distrib's" in log


# In-process: one Connection over a socket pair, the other end played by the test.

@pytest.fixture
def link():
    ours, theirs = socket.socketpair()
    connection = Connection(ours, Peer(1, "worker:1", "127.0.0.1:1"), peer_timeout=2.0)
    yield connection, theirs
    connection.close(timeout=0.5)
    theirs.close()


def test_a_frame_for_another_collective_is_a_protocol_error(link):
    connection, theirs = link
    target = np.zeros(4, np.float32)
    request = connection.post(wire.Kind.DATA, 5, 0, target)
    theirs.sendall(wire.header(wire.Kind.DATA, 6, 0, 16) + b"\0" * 16)
    with pytest.raises(transport.ProtocolError, match="frame 6/0 of 16 bytes.*expects DATA "
                                                      "frame 5/0 of 16 bytes"):
        connection.wait(request)
    assert not target.any()


def test_a_truncated_frame_loses_the_peer(link):
    connection, theirs = link
    request = connection.post(wire.Kind.DATA, 0, 0, np.zeros(4, np.float32))
    theirs.sendall(wire.header(wire.Kind.DATA, 0, 0, 16) + b"\1" * 7)
    theirs.shutdown(socket.SHUT_WR)
    with pytest.raises(transport.PeerLostError, match="in the middle of a frame .7 of 16"):
        connection.wait(request)


def test_silence_loses_the_peer_after_the_timeout(link):
    connection, _ = link
    request = connection.post(wire.Kind.DATA, 0, 0, np.zeros(4, np.float32))
    start = time.monotonic()
    with pytest.raises(transport.PeerLostError, match="sent nothing for 2 s"):
        connection.wait(request)
    assert 2.0 <= time.monotonic() - start < 4.0


def test_fuzzed_frames_raise_transport_errors_never_wrong_data():
    rng = random.Random(0)
    for trial in range(150):
        ours, theirs = socket.socketpair()
        connection = Connection(ours, Peer(1, "worker:1"), peer_timeout=1.0)
        target = np.zeros(8, np.float32)
        request = connection.post(wire.Kind.DATA, 3, 1, target)
        kind = rng.choice(["random", "header", "flip"])
        if kind == "random":
            blob = os.urandom(rng.randrange(1, 80))
        elif kind == "header":
            blob = struct.pack("!4sBBHQQ", rng.choice([wire.MAGIC, b"XXXX"]),
                               rng.choice([1, 2]), rng.randrange(0, 12), rng.randrange(3),
                               rng.randrange(5), rng.choice([0, 31, 32, 33, 1 << 40]))
            blob += os.urandom(rng.randrange(0, 40))
        else:
            good = bytearray(wire.header(wire.Kind.DATA, 3, 1, 32) + b"\x01" * 32)
            good[rng.randrange(24)] ^= 1 << rng.randrange(8)
            blob = bytes(good)
        theirs.sendall(blob)
        theirs.shutdown(socket.SHUT_WR)
        try:
            connection.wait(request)
        except transport.TransportError:
            assert not target.any() or kind == "flip"
        else:
            # Only an intact frame for exactly this collective may be accepted.
            assert blob[:24] == wire.header(wire.Kind.DATA, 3, 1, 32), (trial, blob[:24])
        connection.close(timeout=0.2)
        theirs.close()


def test_parse_header_rejects_anything_malformed():
    peer = Peer(1, "worker:1")
    rng = random.Random(1)
    for _ in range(2000):
        raw = bytes(rng.randrange(256) for _ in range(wire.HEADER.size))
        try:
            kind, _, _, length = wire.parse_header(raw, peer)
        except transport.ProtocolError:
            continue
        assert raw[:4] == wire.MAGIC and kind in wire.Kind
        assert kind == wire.Kind.DATA or length <= wire.MAX_CONTROL_PAYLOAD


def test_results_are_aligned_views_of_reused_buffers():
    arrays = [np.arange(5, dtype=np.float32), np.ones((3, 4), np.float32)]
    layout = Layout(arrays)
    assert layout.starts == [0, 16] and layout.size == 32
    pool = BufferPool()
    first = pool.take(layout.nbytes, layout.dtype)
    assert first.ctypes.data % 64 == 0
    views = layout.views(first)
    del first
    second = pool.take(layout.nbytes, layout.dtype)
    assert len(pool) == 2  # the views keep the first buffer busy
    del views, second
    pool.take(layout.nbytes, layout.dtype)
    assert len(pool) == 2  # reused


def test_any_range_of_a_layout_gathers_its_elements_and_zero_padding():
    arrays = [np.arange(1, 6, dtype=np.float32), np.arange(6, 18, dtype=np.float32)]
    layout = Layout(arrays)
    flat = np.zeros(layout.size, np.float32)
    flat[0:5], flat[16:28] = arrays[0], arrays[1]
    for start in range(layout.size):
        for stop in range(start + 1, layout.size + 1):
            target = np.full(stop - start, np.nan, np.float32)
            layout.gather(arrays, start, stop, target)
            np.testing.assert_array_equal(target, flat[start:stop])
