"""Runs chaos trials under `tf-distrib launch` and tabulates their outcomes."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from tf_distrib.chaos import job
from tf_distrib.chaos.faults import FAULT_KINDS, RESTARTING, Fault, draw
from tf_distrib.launch import launch, snapshots

#: How a trial can end: "equal" (bitwise equal to the fault-free run), "named failure"
#: (the job failed, naming why, with its newest backup restorable), "LOST" (anything
#: else: a different result, a hang, a failure nobody named, an unusable backup, or
#: in-memory snapshots left in /dev/shm).
OUTCOMES = ("equal", "named failure", "LOST")
_TRIAL_TIMEOUT = 300.0
_HANG_TIMEOUT = 30.0
_DISK_BYTES = 4 << 20


@dataclasses.dataclass
class TrialResult:
    """One trial: its faults, how it ended, and what the launcher said.

    Attributes:
        faults: The faults injected.
        outcome: One of `OUTCOMES`.
        struck: Whether every fault left its mark (its attempt failed; a full disk made
            a save fail), so that the trial tested what it drew.
        attempts: Attempts the launcher ran.
        seconds: Wall time of the trial.
        failures: Each failed attempt's failure, as the launcher named it.
        detail: Why a trial is "LOST", or the named failure.
    """

    faults: list[Fault]
    outcome: str
    struck: bool
    attempts: int
    seconds: float
    failures: list[str]
    detail: str = ""


def run_trial(faults: list[Fault], reference: str, workdir: str) -> TrialResult:
    """Runs the chaos job once under `faults`; compares it with the `reference` digest."""
    start = time.monotonic()
    os.makedirs(workdir, exist_ok=True)
    with _backup_disk(workdir, any(f.kind == "full_disk" for f in faults)) as backup_dir:
        result = launch(job.train, 2, kwargs={"backup_dir": backup_dir,
                                              "faults": [dataclasses.asdict(f) for f in faults]},
                        max_restarts=sum(f.kind in RESTARTING for f in faults) + 1,
                        hang_timeout=_HANG_TIMEOUT, startup_timeout=120,
                        timeout=_TRIAL_TIMEOUT, quiet=True,
                        log_dir=os.path.join(workdir, "logs"))
        failures = [a.failure for a in result.attempts if a.failure]
        left_in_memory = snapshots.of_launcher(os.getpid())
        digests = {v["digest"] for v in result.values if v} if result.exit_code == 0 else set()
        if left_in_memory:
            outcome, detail = "LOST", f"in-memory snapshots left behind: {left_in_memory}"
        elif digests == {reference}:
            outcome, detail = "equal", ""
        elif result.exit_code == 0:
            outcome, detail = "LOST", f"final weights differ: {sorted(digests)}"
        elif failures and _restorable(backup_dir):
            outcome, detail = "named failure", failures[-1]
        else:
            outcome = "LOST"
            detail = f"exit {result.exit_code}: {failures[-1] if failures else 'unnamed'}"
    return TrialResult(faults, outcome, all(_struck(f, result) for f in faults),
                       len(result.attempts), time.monotonic() - start, failures, detail)


def _struck(fault: Fault, result) -> bool:
    if fault.attempt >= len(result.attempts):
        return False
    attempt = result.attempts[fault.attempt]
    if fault.kind in RESTARTING:
        return attempt.failure is not None
    return any("No space left on device" in line
               for line in attempt.workers[fault.worker].output)


def run(trials: int, seed: int = 0, workdir: str | None = None, kinds=None,
        echo=print) -> list[TrialResult]:
    """Runs a fault-free reference, then `trials` trials of faults drawn with `seed`.

    Args:
        trials: How many trials, >= 1.
        seed: Seeds the draw of faults. Defaults to 0.
        workdir: Where trials keep backups and logs (kept for what failed). Defaults to
            None: a new temporary directory, deleted at the end.
        kinds: The fault kinds to draw from. Defaults to None: `FAULT_KINDS`, without
            "full_disk" when not root (it mounts a small tmpfs).
        echo: Called with a line per trial. Defaults to print.

    Returns:
        One `TrialResult` per trial.
    """
    if kinds is None:
        kinds = [k for k in FAULT_KINDS if k != "full_disk" or os.geteuid() == 0]
    rng = random.Random(seed)
    return run_trials([draw(rng, kinds) for _ in range(trials)], workdir, echo)


def run_trials(plans: list[list[Fault]], workdir: str | None = None,
               echo=print) -> list[TrialResult]:
    """Runs the reference, then one trial per list of faults in `plans`.

    Args:
        plans: One list of faults per trial (`draw`).
        workdir: Where backups and logs go. Defaults to None: a temporary directory.
        echo: Called with one line per finished trial. Defaults to `print`.
    """
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="tf_distrib_chaos_"))
        reference = launch(job.train, 2, kwargs={"backup_dir": os.path.join(workdir, "ref")},
                           timeout=_TRIAL_TIMEOUT, quiet=True,
                           log_dir=os.path.join(workdir, "ref-logs"))
        if reference.exit_code != 0:
            raise RuntimeError(f"the fault-free chaos job failed: {reference.failure_report()}")
        digest = reference.values[0]["digest"]
        results = []
        for n, faults in enumerate(plans):
            result = run_trial(faults, digest, os.path.join(workdir, f"trial-{n}"))
            results.append(result)
            echo(f"trial {n + 1}/{len(plans)}: {' + '.join(map(str, faults))}: "
                 f"{result.outcome}{'' if result.struck else ' (a fault did not strike)'} "
                 f"({result.attempts} attempts, {result.seconds:.0f} s)"
                 + (f" -- {result.detail}" if result.detail else ""))
            if result.outcome != "LOST":
                shutil.rmtree(os.path.join(workdir, f"trial-{n}"), ignore_errors=True)
        return results


def table(results: list[TrialResult]) -> str:
    """A Markdown table of trials by fault kind and outcome (a trial counts once per kind).

    "struck" counts the trials in which every fault left its mark.
    """
    counts = collections.defaultdict(collections.Counter)
    for result in results:
        for kind in [*{f.kind for f in result.faults}, "all trials"]:
            counts[kind][result.outcome] += 1
            counts[kind]["struck"] += result.struck
    columns = [*OUTCOMES, "struck"]
    lines = ["| fault | trials | " + " | ".join(columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]
    for kind in [*FAULT_KINDS, "all trials"]:
        if counts[kind]:
            trials = sum(counts[kind][o] for o in OUTCOMES)
            row = " | ".join(str(counts[kind][c]) for c in columns)
            lines.append(f"| {kind} | {trials} | {row} |")
    return "\n".join(lines)


@contextlib.contextmanager
def _backup_disk(workdir: str, small_disk: bool):
    """The trial's backup directory; on a small tmpfs of its own for a full disk."""
    disk = os.path.join(workdir, "disk")
    os.makedirs(disk, exist_ok=True)
    if small_disk:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={_DISK_BYTES}", "tmpfs", disk],
                       check=True)
    try:
        yield os.path.join(disk, "backups")
    finally:
        if small_disk:
            subprocess.run(["umount", "--lazy", disk], check=False)


def _restorable(backup_dir: str) -> bool:
    """Whether the newest backup in `backup_dir` (if any) verifies."""
    from tf_distrib.callbacks.backup_store import BackupStore

    store = BackupStore(backup_dir, keep=2)
    return not store.steps() or store.read_latest() is not None


def main(argv: list[str] | None = None) -> int:
    """`tf-distrib chaos`: runs the trials, prints a line per trial and the table.

    Args:
        argv: The command line's arguments. Defaults to None: `sys.argv[1:]`.
    """
    parser = argparse.ArgumentParser(prog="tf-distrib chaos", description=__doc__)
    parser.add_argument("--trials", type=int, default=20, help="how many trials (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the draw of faults")
    parser.add_argument("--workdir", help="keep backups and logs of failed trials here")
    parser.add_argument("--out", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be >= 1, got {args.trials}")
    if os.geteuid() != 0:
        print("tf-distrib chaos: not root: no full-disk faults (they mount a small tmpfs)",
              file=sys.stderr)
    results = run(args.trials, args.seed, args.workdir, echo=lambda line: print(line, flush=True))
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 0 if all(r.outcome != "LOST" and r.struck for r in results) else 1
