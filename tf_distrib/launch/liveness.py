"""Workers that are stopped, or stall before their first step: noticed and named.

The hang watchdog inside a worker counts steps, so the launcher watches from outside:
1. a worker whose process stays stopped (SIGSTOP, a paused container) for
   `STOPPED_GRACE` seconds fails the attempt, in any phase, and is named as the cause
   of a peer's failure;
2. every worker reaches its first step within `startup_timeout` seconds; the one
   furthest behind is named with its phase (`tf_distrib.health.phases`);
3. with a hang timeout, a worker that stays in a rendezvous that its peers passed is
   frozen (one host only; across hosts the workers' own bounds apply).
"""

from __future__ import annotations

import dataclasses
import time

from tf_distrib import cluster as cluster_lib
from tf_distrib.health import phases

#: Seconds a worker may stay stopped (state T) before the attempt fails.
STOPPED_GRACE = 5.0
#: Seconds a rendezvous may take once every worker is in it, however short the hang timeout.
MIN_RENDEZVOUS_SECONDS = 10.0
# Seconds between reads of the workers' phase files.
_READ_SECONDS = 0.5


def process_state(pid: int) -> str | None:
    """Process `pid`'s state letter in /proc (R, S, T, Z, ...); None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name in parentheses may hold spaces and parentheses itself.
    return stat[stat.rfind(b")") + 2:][:1].decode()


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (False where /proc is missing)."""
    return process_state(pid) == "T"


@dataclasses.dataclass
class Stall:
    """A worker the launcher stops the attempt for.

    Attributes:
        worker: Its index among this host's workers of the attempt.
        failure: What happened, naming the worker and its phase.
    """

    worker: int
    failure: str


class Liveness:
    """Watches one attempt's workers on this host.

    Args:
        pids: Each worker's process id.
        first: The global index of this host's first worker.
        reports_dir: Where the workers report their phases.
        attempt: The attempt's number.
        addresses: Each worker's TF_CONFIG address ("host:port").
        startup_timeout: Seconds to reach the first step, or None (no start-up bound).
        hang_timeout: The launch's hang timeout, or None.
        sees_every_worker: Whether these are all the attempt's workers (one host).
    """

    def __init__(self, pids: list[int], first: int, reports_dir: str, attempt: int,
                 addresses: list[str], startup_timeout: float | None,
                 hang_timeout: float | None, sees_every_worker: bool):
        self._pids, self._first, self._dir, self._attempt = pids, first, reports_dir, attempt
        self._addresses = addresses
        self._startup_timeout = startup_timeout
        self._rendezvous_timeout = (None if hang_timeout is None or not sees_every_worker
                                    else max(hang_timeout, MIN_RENDEZVOUS_SECONDS))
        self._started_at = time.monotonic()
        self._stopped_since: list[float | None] = [None] * len(pids)
        self._phases: list[tuple[str, float] | None] = [None] * len(pids)
        self._read_at = 0.0
        self._last_rendezvous = max(phases.ORDER.index(p) for p in phases.RENDEZVOUS)
        self._settled = False
        # A worker alone in its cluster starts no TensorFlow server and waits for nobody.
        self._started = [startup_timeout is None or (sees_every_worker and len(pids) == 1)
                         ] * len(pids)

    def check(self, codes: list[int | None]) -> Stall | None:
        """The first stopped or stalled worker, given the workers' exit codes, or None."""
        now = time.monotonic()
        for i, code in enumerate(codes):
            stopped = code is None and is_stopped(self._pids[i])
            if not stopped:
                self._stopped_since[i] = None
            elif self._stopped_since[i] is None:
                self._stopped_since[i] = now
            elif now - self._stopped_since[i] >= STOPPED_GRACE:
                return self._stopped(i)
        if self._settled:
            return None
        if now >= self._read_at:
            self._read_at = now + _READ_SECONDS
            self._phases = [phases.read(self._dir, self._attempt, self._first + i)
                            for i in range(len(codes))]
        stall = self._startup_stall(codes, now) or self._frozen_in_rendezvous(codes)
        past_rendezvous = [code is not None or self._rank(i) > self._last_rendezvous
                           for i, code in enumerate(codes)]
        self._settled = all(self._started) and (self._rendezvous_timeout is None
                                                or all(past_rendezvous))
        return stall

    @property
    def started(self) -> bool:
        """Whether every worker is past start-up (always, without a start-up bound)."""
        return all(self._started)

    def stopped_now(self) -> Stall | None:
        """A worker that is stopped right now (however briefly), or None."""
        for i, pid in enumerate(self._pids):
            if is_stopped(pid):
                return self._stopped(i)
        return None

    def phase(self, i: int) -> str:
        report = phases.read(self._dir, self._attempt, self._first + i)
        return phases.STARTING if report is None else report[0]

    def _stopped(self, i: int) -> Stall:
        since = self._stopped_since[i]
        duration = "" if since is None else f" for {time.monotonic() - since:.0f} s"
        return Stall(i, f"worker {self._first + i} was stopped (process state T, as after "
                        f"SIGSTOP){duration} during {phases.describe(self.phase(i))}")

    def _startup_stall(self, codes, now) -> Stall | None:
        for i, code in enumerate(codes):
            if not self._started[i]:
                self._started[i] = code is not None or self._past_startup(i)
        if all(self._started) or now - self._started_at <= self._startup_timeout:
            return None
        behind = min((i for i, s in enumerate(self._started) if not s), key=self._rank)
        report = self._phases[behind]
        if report is None:
            where = (f"TensorFlow's server on {self._addresses[behind]} not started; still in "
                     f"{phases.describe(phases.STARTING)}")
        else:
            where = f"still in {phases.describe(report[0])} for {time.time() - report[1]:.0f} s"
        others = [f"worker {self._first + i} in {phases.describe(self._phase_name(i))}"
                  for i, s in enumerate(self._started) if i != behind and not s]
        return Stall(behind, f"worker {self._first + behind} did not reach its first training "
                             f"step within startup_timeout={self._startup_timeout:g} s ({where})"
                     + (f"; waiting: {', '.join(others)}" if others else "")
                     + ". A slow but healthy start-up needs a larger --startup-timeout")

    def _past_startup(self, i: int) -> bool:
        if self._phases[i] is None and cluster_lib.is_listening(self._addresses[i], timeout=0.2):
            # Listening: a script that reports no phases has started; one that does may
            # have reported its first since the last read.
            self._phases[i] = phases.read(self._dir, self._attempt, self._first + i)
            return self._phases[i] is None
        return self._phases[i] is not None and self._phases[i][0] == phases.TRAINING

    def _frozen_in_rendezvous(self, codes) -> Stall | None:
        if self._rendezvous_timeout is None or None in self._phases:
            return None
        ranks = [self._rank(i) for i in range(len(codes))]
        if min(ranks) == max(ranks):
            return None  # nobody is past it: the rendezvous as a whole waits, not one worker
        everyone_since = max(since for _, since in self._phases)
        for i, (phase, _) in enumerate(self._phases):
            if (codes[i] is None and phase in phases.RENDEZVOUS and ranks[i] == min(ranks)
                    and time.time() - everyone_since > self._rendezvous_timeout):
                return Stall(i, f"worker {self._first + i} made no progress in "
                                f"{phases.describe(phase)} for {self._rendezvous_timeout:g} s "
                                "after its peers had passed it (frozen?)")
        return None

    def _phase_name(self, i: int) -> str:
        report = self._phases[i]
        return phases.STARTING if report is None else report[0]

    def _rank(self, i: int) -> int:
        return phases.ORDER.index(self._phase_name(i))
