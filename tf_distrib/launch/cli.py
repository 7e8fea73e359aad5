"""`tf-distrib launch` / `python -m tf_distrib.launch`: the command-line launcher."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tf_distrib.launch.config import FIELDS, LaunchConfig, parse_worker_range
from tf_distrib.launch.errors import LaunchError
from tf_distrib.launch.job import Job, load_job_file
from tf_distrib.launch.launcher import launch

_EPILOG = """\
Each worker gets TF_CONFIG (workers on 127.0.0.1, fresh free ports per attempt) and
TF_DISTRIB_WORKER_INDEX, TF_DISTRIB_NUM_WORKERS, TF_DISTRIB_ATTEMPT,
TF_DISTRIB_MAX_RESTARTS, TF_DISTRIB_STARTUP_TIMEOUT, TF_DISTRIB_HANG_TIMEOUT,
TF_DISTRIB_SECRET and TF_DISTRIB_REPORT_DIR (tf_distrib.contract).

Elastic: -n MIN:MAX drops a worker slot that fails --slot-failures attempts in a row
while MIN remain, and tries it again after --rejoin-interval; with --hosts, --min-hosts
does the same with hosts as the unit (host 0 runs a rendezvous on its first port - 1).

Security: TensorFlow's gRPC servers have no authentication and listen on every
interface (0.0.0.0 is hard-coded in TensorFlow); workers talk over 127.0.0.1, but
firewall their ports on machines reachable from untrusted networks. tf_distrib's own
transport listens on the TF_CONFIG address only and authenticates every connection.

Exit status: 0 when all workers succeed; the first failed worker's status
(128+N for signal N) when restarts run out; 2 for bad input; 130/143 when the
launcher is interrupted.
"""


# Flags that are not `--field-name` of a LaunchConfig field.
_SHORT_FLAGS = {"num_workers": ["-n", "--num-workers"]}


def _parser() -> argparse.ArgumentParser:
    """The launcher's flags: one per `LaunchConfig` field shown on the command line."""
    p = argparse.ArgumentParser(
        prog="tf-distrib launch", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a training script on N local workers with TF_CONFIG; restart "
                    "the group when a worker fails.")
    defaults = LaunchConfig()
    for name, field in FIELDS.items():
        if not field.metadata["cli"]:
            continue
        flags = _SHORT_FLAGS.get(name, [f"--{name.replace('_', '-')}"])
        help_text = field.metadata["help"]
        default = getattr(defaults, name)
        if default not in (None, False, True) and "default" not in help_text:
            help_text += f" (default {default:g})" if isinstance(default, float) \
                else f" (default {default})"
        kind = field.type.split(" ")[0]  # the annotation's text: "float | None" -> "float"
        if kind == "bool":  # on by default, or "bool | None" (None decides): --no-... says no
            action = (argparse.BooleanOptionalAction
                      if "None" in field.type or default is True else "store_true")
            p.add_argument(*flags, dest=name, action=action, default=None, help=help_text)
        else:
            # -n takes "N" or "MIN:MAX"; --hosts a comma-separated list.
            convert = {"int": int, "float": float}.get(kind, str) \
                if name != "num_workers" else str
            p.add_argument(*flags, dest=name, type=convert, help=help_text)
    p.add_argument("--summary-file", help="write a JSON summary of the attempts here")
    p.add_argument("--config", help="job file (YAML or JSON); flags override it")
    p.add_argument("-m", dest="module", help="run a module instead of a script")
    p.add_argument("script", nargs="?", help="training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _job_from_args(options) -> Job:
    """The job file's `Job` (or the defaults) with the flags given on the command line."""
    job = load_job_file(options.config) if options.config else Job()
    if options.module and options.script:
        # With -m, what argparse took as the script is the module's first argument.
        options.args.insert(0, options.script)
        options.script = None
    overrides = {name: getattr(options, name) for name, field in FIELDS.items()
                 if field.metadata["cli"] and getattr(options, name) is not None}
    if "num_workers" in overrides:
        overrides["min_workers"], overrides["num_workers"] = parse_worker_range(
            overrides["num_workers"])
    if "startup_timeout" in overrides:
        overrides["startup_timeout"] = overrides["startup_timeout"] or None  # 0: no check
    if "hosts" in overrides:
        overrides["hosts"] = [h.strip() for h in overrides["hosts"].split(",")]
    job.config = dataclasses.replace(job.config, **overrides)
    if options.module or options.script:
        job.script, job.module, job.args = options.script, options.module, list(options.args)
    job.summary_file = options.summary_file or job.summary_file
    return job


def main(argv: list[str] | None = None) -> int:
    """`tf-distrib launch ...`: run the launch; its exit status (2 for bad input)."""
    options = _parser().parse_args(argv)
    try:
        job = _job_from_args(options)
        result = launch(job.target, args=job.args, config=job.config)
    except LaunchError as e:
        print(f"tf-distrib launch: error: {e}", file=sys.stderr)
        return 2
    if job.summary_file:
        with open(job.summary_file, "w") as f:
            json.dump(summary(result), f, indent=2)
    if result.exit_code:
        print(f"[launcher] failed after {result.restarts} restart(s): "
              f"{result.failure_report()}", file=sys.stderr)
    else:
        print(f"[launcher] all {len(result.workers)} workers exited with 0 after "
              f"{result.restarts} restart(s)", file=sys.stderr)
    return result.exit_code


def summary(result) -> dict:
    """The JSON summary of a launch (for --summary-file)."""
    return {
        "exit_code": result.exit_code,
        "restarts": result.restarts,
        "attempts": [{"number": a.number, "workers": len(a.workers), "members": a.members,
                      "exit_codes": [w.exit_code for w in a.workers], "failure": a.failure,
                      "failed_worker": a.failed_worker, "stopped_first": a.stopped_first,
                      "planned": a.planned}
                     for a in result.attempts],
    }
