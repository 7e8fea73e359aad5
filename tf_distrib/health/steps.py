"""Where each training step's time goes, per worker: the recorder behind `top` and timelines.

Every step of `fit` under a `make_strategy()` strategy reports to its `StepRecorder`:
the step's wall-clock span, its input wait (measured inside the step's graph), the time
its collectives spent exchanging and waiting for peers (from the transport's counters)
and backup spans. The recorder keeps the last steps, writes this worker's status file
about once a second for `tf-distrib top` (`STATUS_FILE` in TF_DISTRIB_STATUS_DIR), and
its events for a Chrome trace (`tf_distrib.health.timeline`). Plain Python, no
TensorFlow: the launcher and `top` read what it writes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable

from tf_distrib import contract
from tf_distrib.health import phases

#: Steps the recorder keeps (and a timeline shows) by default.
DEFAULT_STEPS = 200
#: Seconds between two writes of a worker's status file.
STATUS_SECONDS = 1.0
#: Steps whose mean `top` shows.
RECENT_STEPS = 20
STATUS_FILE = "worker-{index}.json"
# An input wait longer than this may hold a collective (read the transport's records).
_INPUT_COLLECTIVES_SECONDS = 0.0005
# The strategy's attribute that holds its recorder.
_ATTRIBUTE = "_tf_distrib_step_recorder"


@dataclasses.dataclass
class Step:
    """One training step of this worker; times in seconds, `started`/`ended` wall-clock.

    Attributes:
        number: The step's number in this process (from 0).
        started: When the step's call began.
        ended: When it returned.
        input_wait: Waiting for the input pipeline's next batch.
        exchange: Inside collectives, working (copies, sums, sends).
        peer_wait: Inside collectives, waiting for a slower peer.
        backup: Backups that blocked training since the step before.
        examples: Examples this worker trained on in the step.
        input_span: (start, end) of the wait for input, wall-clock, or None.
    """

    number: int
    started: float
    ended: float
    input_wait: float = 0.0
    exchange: float = 0.0
    peer_wait: float = 0.0
    backup: float = 0.0
    examples: int = 0
    input_span: tuple[float, float] | None = None

    @property
    def duration(self) -> float:
        """The step's time: its call, and the backups that blocked training before it."""
        return self.ended - self.started + self.backup

    @property
    def compute(self) -> float:
        """What is left of the step: the model's forward and backward, the optimizer."""
        return max(0.0, self.ended - self.started - self.input_wait - self.exchange
                   - self.peer_wait)


@dataclasses.dataclass
class Span:
    """Something that took time beside the steps: a collective or a backup's part."""

    name: str
    track: str
    started: float
    ended: float
    args: dict = dataclasses.field(default_factory=dict)


class StepRecorder:
    """The last steps of this worker, its status for `top`, its timeline's events.

    Args:
        worker: This worker's index. Defaults to None: the launcher's
            TF_DISTRIB_WORKER_INDEX, else 0.
        keep: How many of the last steps to keep. Defaults to `DEFAULT_STEPS`.
        status_dir: Where to write this worker's status file. Defaults to None:
            TF_DISTRIB_STATUS_DIR, else nowhere.
        counters: Returns (seconds in collectives, of which waiting for peers, bytes
            exchanged) so far, or None without a transport. Defaults to None.
        collectives: Returns the transport's last collectives (`Transport.recent()`),
            for the timeline. Defaults to None.

    Example:

    ```python
    recorder = StepRecorder(worker=0)
    recorder.begin()
    ...  # one training step
    recorder.end(input_wait=0.001, examples=128)
    print(recorder.status()["step_time"])
    ```
    """

    def __init__(self, worker: int | None = None, keep: int = DEFAULT_STEPS,
                 status_dir: str | None = None,
                 counters: Callable[[], tuple[float, float, int]] | None = None,
                 collectives: Callable[[], list[dict]] | None = None):
        index = contract.worker_index() if worker is None else worker
        self.worker = 0 if index is None else index
        self.steps: collections.deque[Step] = collections.deque(maxlen=keep)
        self.spans: collections.deque[Span] = collections.deque(maxlen=keep * 8)
        self.status_dir = status_dir or os.environ.get(contract.ENV_STATUS_DIR) or None
        self._counters, self._collectives = counters, collectives
        self.collecting = False  # whether to keep every collective's span (timelines)
        self._lock = threading.Lock()
        self._number = 0
        self._began = time.time()
        self._began_counters = (0.0, 0.0, 0)
        self.bytes_exchanged = 0
        self._last_seq = -1
        self._blocked = 0.0  # backup time that blocked training since the last step
        self._written = 0.0
        self._cpu = (time.monotonic(), _cpu_seconds())

    def begin(self) -> None:
        """Marks the start of a step's call."""
        self._began = time.time()
        self._began_counters = self._read_counters()

    def end(self, input_wait: float = 0.0, examples: int = 0,
            input_span: tuple[float, float] | None = None) -> Step:
        """Records the step whose call just returned; writes the status file when due."""
        now = time.time()
        counters = self._read_counters()
        seconds, waited, nbytes = (a - b for a, b in zip(counters, self._began_counters,
                                                         strict=True))
        if input_span is not None and input_wait > _INPUT_COLLECTIVES_SECONDS:
            # TensorFlow's per-step "has every replica data" collective runs inside
            # get_next: its time is the collectives', not the input pipeline's.
            input_wait = max(0.0, input_wait - self._collective_time(*input_span))
        with self._lock:
            blocked, self._blocked = self._blocked, 0.0
        step = Step(self._number, self._began, now, input_wait=input_wait,
                    exchange=max(0.0, seconds - waited), peer_wait=waited, backup=blocked,
                    examples=examples, input_span=input_span)
        self.steps.append(step)
        self._number += 1
        self.bytes_exchanged += nbytes
        if self.collecting and self._number % 8 == 0:  # 8 steps' collectives fit its ring
            self.take_collectives()
        if self.status_dir and now - self._written >= STATUS_SECONDS:
            self.write_status()
        return step

    def add_span(self, name: str, track: str, started: float, ended: float,
                 blocked: bool = False, **args) -> None:
        """Records something beside the steps; `blocked`: training waited for it."""
        with self._lock:
            self.spans.append(Span(name, track, started, ended, args))
            if blocked:
                self._blocked += ended - started

    def _collective_time(self, started: float, ended: float) -> float:
        if self._collectives is None:
            return 0.0
        return sum(r["ended"] - r["started"] for r in self._collectives()
                   if r.get("ended") and r["started"] >= started and r["ended"] <= ended)

    def take_collectives(self) -> None:
        """Adds the transport's collectives finished since the last call as spans."""
        if self._collectives is None:
            return
        for record in self._collectives():
            if record["seq"] > self._last_seq and record.get("ended"):
                self.add_span(f"all-reduce {record['seq']}", "collectives", record["started"],
                              record["ended"], seq=record["seq"], bytes=record["bytes"])
                self._last_seq = record["seq"]

    def status(self, recent: int = RECENT_STEPS) -> dict:
        """This worker's state: its step and the means of its last `recent` steps."""
        steps = list(self.steps)[-recent:]
        mean = lambda f: sum(f(s) for s in steps) / len(steps) if steps else 0.0  # noqa: E731
        # The rate over the steps' whole span: what happens between them counts too.
        elapsed = steps[-1].ended - steps[0].started if steps else 0.0
        rate = sum(s.examples for s in steps) / elapsed if elapsed > 0 else 0.0
        now, cpu = time.monotonic(), _cpu_seconds()
        cpu_percent = 100.0 * (cpu - self._cpu[1]) / max(1e-9, now - self._cpu[0])
        self._cpu = (now, cpu)
        return {
            "worker": self.worker, "pid": os.getpid(), "attempt": contract.attempt(),
            "phase": phases.current(), "step": self._number, "time": time.time(),
            "examples_per_sec": rate,
            "step_time": mean(lambda s: s.duration), "compute": mean(lambda s: s.compute),
            "input_wait": mean(lambda s: s.input_wait), "exchange": mean(lambda s: s.exchange),
            "peer_wait": mean(lambda s: s.peer_wait), "backup": mean(lambda s: s.backup),
            "bytes_exchanged": self.bytes_exchanged, "cpu_percent": cpu_percent,
            "rss_bytes": _rss_bytes(),
        }

    def write_status(self) -> None:
        """Writes `status()` to this worker's status file (atomically; errors ignored)."""
        self._written = time.time()
        path = os.path.join(self.status_dir, STATUS_FILE.format(index=self.worker))
        try:
            os.makedirs(self.status_dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(self.status(), f)
            os.replace(path + ".tmp", path)
        except OSError:
            pass  # the launcher's directory is gone: nobody is watching

    def _read_counters(self) -> tuple[float, float, int]:
        return self._counters() if self._counters is not None else (0.0, 0.0, 0)


def recorder_of(strategy, create: bool = False, keep: int | None = None) -> StepRecorder | None:
    """The `StepRecorder` of a `make_strategy()` strategy, made first when `create`.

    Its counters come from the strategy's transport, when it has one.

    Args:
        strategy: The strategy whose steps are recorded.
        create: Make the recorder if the strategy has none. Defaults to False.
        keep: Keep at least this many steps. Defaults to None: `DEFAULT_STEPS`.
    """
    recorder = getattr(strategy, _ATTRIBUTE, None)
    if recorder is None and create:
        transport = getattr(strategy, "transport", None)
        counters = collectives = None
        worker = None
        if transport is not None:
            def counters():
                stats = transport.stats
                return stats.seconds, stats.waited, stats.bytes

            collectives, worker = transport.recent, transport.rank
        recorder = StepRecorder(worker, keep or DEFAULT_STEPS, counters=counters,
                                collectives=collectives)
        setattr(strategy, _ATTRIBUTE, recorder)
    if recorder is not None and keep and keep > recorder.steps.maxlen:
        recorder.steps = collections.deque(recorder.steps, maxlen=keep)
        recorder.spans = collections.deque(recorder.spans, maxlen=keep * 8)
    return recorder


def read_status(directory: str) -> list[dict]:
    """Every worker's last status in `directory` (the launcher's status directory)."""
    found = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        if name.startswith("worker-") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    found.append(json.load(f))
            except (OSError, ValueError):
                continue  # being replaced right now: the next refresh reads it
    return sorted(found, key=lambda s: s.get("worker", 0))


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
