"""PyTorch DistributedDataParallel on the same model, batch and pinning: the peer to beat.

Runs only where torch happens to be installed (tf_distrib never depends on it): gloo on
127.0.0.1, one intra-op thread and one core per process, SGD, the scaling benchmark's
models (`tf_distrib.bench.models`: the MLP 784-1024-1024-10 or the CNN) and batch per
process. One process trains the plain model; two wrap it in DDP. With
`accumulation=K`, gradients are accumulated over K steps and DDP all-reduces once per K
(`no_sync()` on the others), as PyTorch's documentation recommends.
"""

from __future__ import annotations

import importlib.util
import os
import time


def available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _model(torch, name: str):
    """The same architecture as `tf_distrib.bench.models` (`mlp` 1024-1024, `cnn`)."""
    nn = torch.nn
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    layers, channels = [], 3
    for filters in (32, 64, 64):
        layers += [nn.Conv2d(channels, filters, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        channels = filters
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def train_worker(port: int, steps: int, batch: int, accumulation: int, model_name: str,
                 master: str = "127.0.0.1", powersgd_rank: int | None = None) -> dict:
    """One PyTorch process of the job (gloo DDP when there are several), on one core.

    Args:
        port: The rendezvous port on `master`.
        steps: Optimizer steps to time (after warm-up).
        batch: Examples per process per step.
        accumulation: Micro-batches per step (DDP's `no_sync` on all but the last).
        model_name: "mlp" or "cnn".
        master: Rank 0's address. Defaults to "127.0.0.1".
        powersgd_rank: DDP's `powerSGD_hook` at this rank, compressing from step 10 (the
            warm-up epoch's). Defaults to None: no hook.

    Returns:
        The same fields as `tf_distrib.bench.scaling.train_worker`.
    """
    import contextlib

    import torch
    import torch.distributed as dist

    from tf_distrib.bench import cpu_seconds

    rank = int(os.environ["TF_DISTRIB_WORKER_INDEX"])
    world = int(os.environ["TF_DISTRIB_NUM_WORKERS"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(torch, model_name)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                                world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
        if powersgd_rank:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            model.register_comm_hook(powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=10),
                powerSGD_hook.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.rand(steps, batch, *((784,) if model_name == "mlp" else (3, 32, 32)))
    y = torch.randint(0, 10, (steps, batch))

    def epoch():
        for i in range(steps):
            update = (i + 1) % accumulation == 0
            quiet = model.no_sync() if world > 1 and not update else contextlib.nullcontext()
            with quiet:
                (torch.nn.functional.cross_entropy(model(x[i]), y[i]) / accumulation).backward()
            if update:
                optimizer.step()
                optimizer.zero_grad()

    epoch()  # warm-up
    start, cpu = time.perf_counter(), cpu_seconds()
    epoch()
    result = {"examples_per_sec": steps * batch * world / (time.perf_counter() - start),
              "cpu_per_step": (cpu_seconds() - cpu) / steps}
    if world > 1:
        dist.destroy_process_group()
    return result


def measure(workers: int, model: str = "mlp", steps: int = 60, batch: int = 128,
            accumulation: int = 1) -> dict:
    """{"examples_per_sec": global, "cpu_per_step": seconds} of `workers` pinned PyTorch
    processes training `model` ("mlp" or "cnn"), in one run; a run in which a process
    failed before it returned its measurement is tried once more (`measured`).
    """
    from tf_distrib.cluster import free_ports
    from tf_distrib.launch import launch

    for attempt in range(2):
        result = launch(train_worker, workers,
                        args=(free_ports(1)[0], steps, batch, accumulation, model), quiet=True,
                        startup_timeout=None, timeout=600)
        values = measured(result)
        if values is not None:
            return {"examples_per_sec": values[0]["examples_per_sec"],
                    "cpu_per_step": sum(v["cpu_per_step"] for v in values) / len(values)}
        print(f"  (PyTorch run {attempt + 1} failed: {result.failure_report(lines=2)})",
              flush=True)
    raise RuntimeError(result.failure_report())


def measured(result) -> list | None:
    """What each process of a `launch` returned, or None if one returned nothing.

    Now and then a gloo process aborts as it exits ("terminate called without an active
    exception": three times in two `bench scaling` runs on 2026-12-04), after it has
    returned what it measured; such a run counts, where a retry after every failure left
    a benchmark of half an hour to fail whenever two runs in a row aborted.
    """
    values = result.values
    return values if all(v is not None for v in values) else None
