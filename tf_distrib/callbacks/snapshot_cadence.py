"""How often `BackupAndRestore` snapshots into memory: every step, or as a cost budget allows."""

from __future__ import annotations

import itertools
import math
import statistics
import time

from tf_distrib.callbacks import snapshot_peers

#: The share of the step time that snapshots may take with `snapshot_freq="auto"`.
COST_BUDGET = 0.03
# Steps measured before the interval is chosen; the first of them (tracing, warm-up) are
# left out of the medians.
_MEASURED_STEPS, _WARM_UP_STEPS = 10, 2
# One key prefix per `fit`: every worker counts its fits alike.
_runs = itertools.count(1)


class SnapshotCadence:
    """Snapshots every `freq` steps, or with "auto" as often as `COST_BUDGET` allows.

    "auto" snapshots every step for the first `_MEASURED_STEPS` steps of a `fit`,
    timing the steps and the copies; then every worker takes the smallest interval
    that keeps its copies within the budget, and all take the largest of those, so
    that they snapshot at the same steps.

    Args:
        freq: "auto", or a positive number of steps.
        strategy: The model's strategy.
        multi_worker: Whether `strategy` spans several workers, which then agree on
            the interval.
        verbose: Print the interval "auto" chose. Defaults to False.

    Attributes:
        key: This `fit`'s prefix in the coordination service's key-value store.
    """

    def __init__(self, freq, strategy, multi_worker: bool, verbose: bool = False):
        self.auto = freq == "auto"
        self._verbose = verbose
        self.every = 1 if self.auto else int(freq)
        self._strategy = strategy if multi_worker else None
        self.key = f"tf_distrib/snapshots/{next(_runs)}"
        self._steps: list[float] = []
        self._copies: list[float] = []
        self._last_end: float | None = None
        self._copy_seconds = 0.0

    def due(self, global_step: int, steps: int) -> bool:
        """Whether the batch that ended at `global_step` (`steps` of them) is snapshot."""
        now = time.perf_counter()
        if self.auto and self._last_end is not None:
            self._steps.append((now - self._last_end - self._copy_seconds) / steps)
            if len(self._steps) == _MEASURED_STEPS:
                self._choose()
        self._last_end, self._copy_seconds = now, 0.0
        return global_step // self.every > (global_step - steps) // self.every

    def copied(self, seconds: float) -> None:
        """Records that a snapshot took `seconds` of the training thread."""
        self._copy_seconds = seconds
        if self.auto:
            self._copies.append(seconds)

    def _choose(self) -> None:
        step = statistics.median(self._steps[_WARM_UP_STEPS:])
        copy = statistics.median(self._copies[_WARM_UP_STEPS:] or self._copies)
        mine = max(1, math.ceil(copy / (COST_BUDGET * step))) if step > 0 else 1
        self.every = max(int(every) for every in snapshot_peers.gather(
            self._strategy, f"{self.key}/every", str(mine), timeout=300.0))
        if self._verbose:
            print(f"BackupAndRestore: an in-memory snapshot every {self.every} step(s) (a "
                  f"copy takes {copy * 1e3:.2f} ms of a {step * 1e3:.1f} ms step here; "
                  f"budget {COST_BUDGET:.0%})", flush=True)

