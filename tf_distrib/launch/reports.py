"""What the launcher learns from its workers' flight-recorder reports.

Each worker that its hang watchdog stops, or that loses a peer, writes a report to
TF_DISTRIB_REPORT_DIR (`tf_distrib.health.failure_report`). A hung worker is one the others wait
for: a worker blocked in a collective reports the peers it waits for, and a worker
that lost a peer names it. The worker(s) waited for, that are not themselves waiting,
stopped first. Without that evidence (TensorFlow's collective reports nothing): among
the workers with the fewest finished steps, those stuck outside a step (in a callback,
say) while the others wait inside one; else all of them.
"""

from __future__ import annotations

import json
import re

from tf_distrib.health import failure_report

_PEER = re.compile(r"\b(chief|worker):(\d+) \(")


def read(directory: str, attempt: int) -> dict[int, dict]:
    """The reports of `attempt`'s workers, by worker index."""
    reports = {}
    for index, path in failure_report.paths(directory, attempt).items():
        try:
            with open(path) as f:
                reports[index] = json.load(f)
        except (OSError, ValueError):
            continue  # half written by a worker that was killed
    return reports


def stopped_first(reports: dict[int, dict]) -> list[int]:
    """The workers whose progress stopped first, by the reports' evidence."""
    waiting, waited_for = set(), set()
    for index, report in reports.items():
        named = set(_peers((report.get("transport") or {}).get("waiting_for", [])))
        if report.get("lost_peer"):
            named |= set(_peers([report["lost_peer"] + " ("]))
        if named:
            waiting.add(index)
            waited_for |= named
    culprits = sorted(waited_for - waiting)
    if culprits:
        return culprits
    steps = {i: r["steps"] for i, r in reports.items() if r.get("steps") is not None}
    if not steps:
        return []
    behind = [i for i, n in steps.items() if n == min(steps.values())]
    outside = [i for i in behind if not reports[i].get("in_step")]
    inside = [i for i in reports if reports[i].get("in_step")]
    return sorted(outside if outside and inside else behind)


def describe(reports: dict[int, dict], culprits: list[int]) -> str:
    """A sentence naming `culprits` and what their reports say."""
    parts = []
    for index in culprits:
        report = reports.get(index)
        if report is None:
            parts.append(f"worker {index} (no report: it could not write one; stopped or "
                         "killed?)")
        elif report.get("steps") is not None:
            parts.append(f"worker {index} (its last finished step: {report['steps']}; "
                         f"{report['cause']})")
        else:
            parts.append(f"worker {index} ({report['cause']})")
    witnesses = sorted(set(reports) - set(culprits))
    return ("stopped first: " + ", ".join(parts)
            + (f"; named by the flight recorders of worker(s) {witnesses}" if witnesses else ""))


def _peers(texts) -> list[int]:
    """Worker indices named as "worker:i (" in `texts` (the launcher's tasks are workers)."""
    return [int(m.group(2)) for text in texts for m in _PEER.finditer(text)
            if m.group(1) == "worker"]
