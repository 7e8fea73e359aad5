"""Elastic membership on one host: which worker slots run the next attempt.

A slot that fails `slot_failures` attempts in a row (the first failed worker, or the
one the flight recorders name) is dropped, while at least `minimum` slots remain. A
dropped slot is tried again at the first restart `rejoin_interval` seconds after it
was dropped; if the smaller group runs that long without failing, the launcher stops
it as on preemption (its workers save and exit 42) so that the slot can rejoin.
"""

from __future__ import annotations

import dataclasses
import math
import time


@dataclasses.dataclass
class Slots:
    """The worker slots of one host and their recent failures.

    Attributes:
        count: Slots (the most workers an attempt runs).
        minimum: The fewest workers an attempt may run.
        slot_failures: Failed attempts in a row that drop a slot.
        rejoin_interval: Seconds before a dropped slot is tried again (inf: never).
    """

    count: int
    minimum: int
    slot_failures: int
    rejoin_interval: float = math.inf
    failures: list[int] = dataclasses.field(default_factory=list)
    dropped: dict[int, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.failures = [0] * self.count

    def active(self) -> list[int]:
        """The slots the next attempt runs, in order (their workers' indices follow it)."""
        return [s for s in range(self.count) if s not in self.dropped]

    def record_failure(self, ran: list[int], culprits: list[int]) -> list[int]:
        """Counts a failed attempt against `culprits` (slots); returns the slots dropped."""
        newly = []
        for slot in ran:
            self.failures[slot] = self.failures[slot] + 1 if slot in culprits else 0
        for slot in culprits:
            if (self.failures[slot] >= self.slot_failures
                    and len(self.active()) - 1 >= self.minimum):
                self.dropped[slot] = time.monotonic()
                newly.append(slot)
        return newly

    def rejoin_at(self) -> float | None:
        """When (time.monotonic) the oldest dropped slot may be tried again, or None."""
        if not self.dropped or self.rejoin_interval == math.inf:
            return None
        return min(self.dropped.values()) + self.rejoin_interval

    def rejoin_due(self) -> list[int]:
        """Takes back the dropped slots whose rejoin interval has passed; returns them."""
        now = time.monotonic()
        due = [s for s, t in self.dropped.items() if now - t >= self.rejoin_interval]
        for slot in due:
            del self.dropped[slot]
            # One more failure drops it again at once.
            self.failures[slot] = self.slot_failures - 1
        return due
