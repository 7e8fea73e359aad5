"""Chrome trace-event timelines of the last steps of every worker, clocks aligned.

Each worker turns its `StepRecorder` into a part (`write_part`): trace events for each
step (its input wait nested inside), each collective (one per gradient bucket, the
logged values' too) and each backup span, on wall-clock time. `merge` joins the parts
into one trace, one process per worker, and aligns the workers' clocks on their
collectives: a collective ends at about the same moment on every worker, so each
worker's clock is shifted by the median difference of its collectives' ends from
worker 0's (hosts whose clocks disagree line up too). The file opens in Perfetto
(ui.perfetto.dev) and chrome://tracing.
"""

from __future__ import annotations

import json
import os
import statistics

from tf_distrib.health.steps import StepRecorder

#: The tracks of a worker's process in the trace, as thread ids.
TRACKS = {"steps": 0, "collectives": 1, "backup": 2}


def write_part(recorder: StepRecorder, path: str) -> None:
    """Writes this worker's events and its collectives' ends to `path` (JSON).

    Args:
        recorder: This worker's recorder.
        path: The part's file; its directory is made if missing.
    """
    if recorder.collecting:
        recorder.take_collectives()
    events = []
    for step in recorder.steps:
        events.append(_span(f"step {step.number}", "steps", step.started, step.ended, {
            "compute_ms": round(step.compute * 1e3, 3),
            "input_wait_ms": round(step.input_wait * 1e3, 3),
            "exchange_ms": round(step.exchange * 1e3, 3),
            "peer_wait_ms": round(step.peer_wait * 1e3, 3),
            "backup_ms": round(step.backup * 1e3, 3), "examples": step.examples}))
        if step.input_span is not None:
            events.append(_span("input wait", "steps", *step.input_span, {}))
    first = recorder.steps[0].started if recorder.steps else 0.0
    ends = {}
    for span in recorder.spans:
        if span.ended < first:
            continue
        events.append(_span(span.name, span.track, span.started, span.ended, span.args))
        if "seq" in span.args:
            ends[span.args["seq"]] = span.ended
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"worker": recorder.worker, "events": events, "collective_ends": ends}, f)
    os.replace(path + ".tmp", path)


def merge(parts: list[str], out: str) -> dict:
    """Joins workers' parts into one Chrome trace at `out`, clocks aligned on collectives.

    Args:
        parts: The parts' paths (`write_part`); unreadable ones are left out.
        out: The trace's path.

    Returns:
        The trace (`{"traceEvents": [...], ...}`), as written.
    """
    loaded = []
    for path in parts:
        try:
            with open(path) as f:
                loaded.append(json.load(f))
        except (OSError, ValueError):
            continue
    loaded.sort(key=lambda p: p["worker"])
    reference = loaded[0]["collective_ends"] if loaded else {}
    events, offsets = [], {}
    for part in loaded:
        common = [reference[k] - part["collective_ends"][k] for k in part["collective_ends"]
                  if k in reference]
        offset = statistics.median(common) if common else 0.0
        offsets[part["worker"]] = offset
        pid = part["worker"]
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"worker {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                       "args": {"sort_index": pid}})
        for track, tid in TRACKS.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": track}})
        for event in part["events"]:
            events.append({**event, "pid": pid, "ts": event["ts"] + offset * 1e6})
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"clock_offsets_seconds": {str(k): v for k, v in offsets.items()}}}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(trace, f)
    os.replace(out + ".tmp", out)
    return trace


def part_path(directory: str, worker: int) -> str:
    """Where worker `worker` writes its part in a launch's timeline directory."""
    return os.path.join(directory, f"worker-{worker}.json")


def _span(name: str, track: str, started: float, ended: float, args: dict) -> dict:
    return {"ph": "X", "name": name, "cat": track, "tid": TRACKS.get(track, 3),
            "ts": started * 1e6, "dur": max(0.0, ended - started) * 1e6, "args": args}
