"""`tf-distrib top [LOG_DIR]`: a live view of a running `tf-distrib launch` job, per worker.

The launcher writes `launch.json` (its state, attempts and restarts) into its log
directory and registers itself in `jobs_dir()`; each worker writes its
status (`tf_distrib.health.steps`) into `status/` there about once a second. `top`
reads both, from any terminal: one row per worker with its phase, step, examples/s,
step time and its split, CPU and memory, the straggler marked. Reading files costs the
workers nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

from tf_distrib.health import steps

#: A worker is the straggler when its own time per step (compute, input wait, backup)
#: exceeds the fastest worker's by this fraction and by at least `STRAGGLER_SECONDS`.
STRAGGLER_RATIO = 0.25
STRAGGLER_SECONDS = 0.005
LAUNCH_FILE = "launch.json"
STATUS_DIR = "status"
#: Columns of `--json`, in seconds where they are times.
FIELDS = ("worker", "phase", "step", "examples_per_sec", "step_time", "compute", "input_wait",
          "exchange", "peer_wait", "backup", "cpu_percent", "rss_bytes", "restarts",
          "straggler")


class NoJob(Exception):
    """The directory is no running job's; the message says what it is instead."""


def jobs_dir() -> str:
    """Where running launches register: tf_distrib-jobs-UID in the temporary directory
    (volatile state, like the launches' default log directories beside it)."""
    return os.path.join(tempfile.gettempdir(), f"tf_distrib-jobs-{os.getuid()}")


def register(log_dir: str) -> str | None:
    """The launcher's side: records this launch's log directory for `top` to find.

    Returns:
        The registration's path (the launcher removes it at its end), or None when the
        jobs directory cannot be written: `top LOG_DIR` still works then.
    """
    path = os.path.join(jobs_dir(), f"{os.getpid()}.json")
    try:
        os.makedirs(jobs_dir(), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"log_dir": os.path.abspath(log_dir), "pid": os.getpid()}, f)
    except OSError:
        return None
    return path


def write_launch(log_dir: str, **state) -> None:
    """The launcher's side: its state (running or finished, attempt, restarts, ...)."""
    path = os.path.join(log_dir, LAUNCH_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "time": time.time(), **state}, f)
    os.replace(path + ".tmp", path)


def newest_job() -> str:
    """The log directory of the newest launch of this user that is still going.

    Raises:
        NoJob: no launch of this user is running.
    """
    running = []
    try:
        names = os.listdir(jobs_dir())
    except OSError:
        names = []
    for name in names:
        path = os.path.join(jobs_dir(), name)
        try:
            with open(path) as f:
                entry = json.load(f)
            os.kill(entry["pid"], 0)
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                os.unlink(path)  # its launcher is gone (killed before it could say so)
            continue
        running.append((os.path.getmtime(os.path.join(jobs_dir(), name)), entry["log_dir"]))
    if not running:
        raise NoJob("no `tf-distrib launch` job of this user is running; give its log "
                    "directory (printed at its start) as tf-distrib top LOG_DIR.")
    return max(running)[1]


def snapshot(log_dir: str) -> list[dict]:
    """One row per worker of the running job in `log_dir`, the straggler marked.

    Raises:
        NoJob: `log_dir` holds no job, or its job has finished.
    """
    try:
        with open(os.path.join(log_dir, LAUNCH_FILE)) as f:
            launch = json.load(f)
    except (OSError, ValueError):
        raise NoJob(f"{log_dir} is not a tf-distrib launch's log directory (no "
                    f"{LAUNCH_FILE}).") from None
    if launch.get("state") != "running" or not _alive(launch.get("pid")):
        raise NoJob(f"the job in {log_dir} has finished (exit status "
                    f"{launch.get('exit_code', 'unknown')}, {launch.get('restarts', 0)} "
                    "restart(s)).")
    rows = [s for s in steps.read_status(os.path.join(log_dir, STATUS_DIR))
            if s.get("attempt") == launch.get("attempt")]
    straggler = _straggler(rows)
    return [{**{k: row.get(k) for k in FIELDS}, "restarts": launch.get("restarts", 0),
             "straggler": row["worker"] == straggler} for row in rows]


def _straggler(rows: list[dict]) -> int | None:
    own = {r["worker"]: r["compute"] + r["input_wait"] + r["backup"]
           for r in rows if r.get("step")}
    if len(own) < 2:
        return None
    slowest = max(own, key=own.get)
    fastest = min(own.values())
    if own[slowest] > fastest * (1 + STRAGGLER_RATIO) and \
            own[slowest] - fastest >= STRAGGLER_SECONDS:
        return slowest
    return None


def render(rows: list[dict], log_dir: str) -> str:
    """The frame `top` shows: a header, then one line per worker."""
    ms = lambda s: f"{(s or 0) * 1e3:7.1f}"  # noqa: E731
    lines = [f"tf-distrib top: {log_dir}  ({time.strftime('%H:%M:%S')}; times in ms per "
             "step, means of the last steps)",
             f"{'worker':>6} {'phase':>10} {'step':>7} {'ex/s':>9} {'time':>7} {'compute':>7} "
             f"{'input':>7} {'exch':>7} {'peers':>7} {'backup':>7} {'cpu%':>5} {'rss MB':>7} "
             f"{'rst':>3}"]
    for r in rows:
        lines.append(
            f"{r['worker']:>6} {r['phase']:>10} {r['step']:>7} {r['examples_per_sec']:>9.0f} "
            f"{ms(r['step_time'])} {ms(r['compute'])} {ms(r['input_wait'])} "
            f"{ms(r['exchange'])} {ms(r['peer_wait'])} {ms(r['backup'])} "
            f"{r['cpu_percent']:>5.0f} {r['rss_bytes'] / 2**20:>7.0f} {r['restarts']:>3}"
            + ("  <- straggler" if r["straggler"] else ""))
    if not rows:
        lines.append("  (no worker has finished a step yet)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`tf-distrib top [LOG_DIR] [--once] [--json]`: exit status 1 when there is no job."""
    parser = argparse.ArgumentParser(prog="tf-distrib top", description=__doc__.split("\n")[0])
    parser.add_argument("log_dir", nargs="?",
                        help="the job's log directory (default: this user's newest job)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per worker (times in seconds) and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    options = parser.parse_args(argv)
    try:
        log_dir = options.log_dir or newest_job()
        rows = snapshot(log_dir)
        if options.json:
            for row in rows:
                print(json.dumps(row))
            return 0
        if options.once:
            print(render(rows, log_dir))
            return 0
        while True:
            sys.stdout.write("\033[H\033[2J" + render(rows, log_dir) + "\n")
            sys.stdout.flush()
            time.sleep(options.interval)
            rows = snapshot(log_dir)
    except NoJob as e:
        print(f"tf-distrib top: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, TypeError, ValueError):
        return False
