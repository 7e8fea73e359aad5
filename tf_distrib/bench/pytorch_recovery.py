"""`bench recovery`'s scenario as PyTorch users run it: a torchrun worker with DDP (gloo).

`python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 -m
tf_distrib.bench.pytorch_recovery DIR KILL_AFTER STEPS EPOCHS`: the MLP 784-1024-1024-10
with Adam, 128 examples per worker per step; rank 0 saves model and optimizer with
`torch.save` at each epoch's end (PyTorch's DDP tutorial); a restarted group loads it.
Before any restart rank 1 SIGKILLs itself after KILL_AFTER steps; the restarted ranks
write the time of their first finished step and the step they resumed from, in
`bench.recovery`'s files. Runs only where torch is installed.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main(directory: str, kill_after: int, steps: int, epochs: int) -> None:
    import torch
    import torch.distributed as dist

    from tf_distrib.bench.pytorch_ddp import _model
    from tf_distrib.bench.recovery import _write

    rank, restarts = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(_model(torch, "mlp"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    x = torch.rand(steps, 128, 784, generator=generator)
    y = torch.randint(0, 10, (steps, 128), generator=generator)
    checkpoint, start = os.path.join(directory, "checkpoint.pt"), 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
    done = 0
    for step in range(start, steps * epochs):
        loss = torch.nn.functional.cross_entropy(model(x[step % steps]), y[step % steps])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done += 1
        if restarts == 1 and done == 1:
            _write(directory, f"first-step-{rank}", time.time())
            _write(directory, f"resumed-{rank}", start)
        if restarts == 0 and rank == 1 and done == kill_after:
            _write(directory, "killed", time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % steps == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
