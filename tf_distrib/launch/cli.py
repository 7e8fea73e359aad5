"""`tf-distrib launch` / `python -m tf_distrib.launch`: the command-line launcher."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tf_distrib.launch.errors import LaunchError
from tf_distrib.launch.job import DEFAULTS, JobConfig, load_job_file, parse_worker_range
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tf-distrib launch", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a training script on N local workers with TF_CONFIG; restart "
                    "the group when a worker fails.")
    p.add_argument("-n", "--num-workers",
                   help=f"workers on this host, N or MIN:MAX (elastic) "
                        f"(default {DEFAULTS.num_workers})")
    p.add_argument("--max-restarts", type=int,
                   help=f"restarts after failures (default {DEFAULTS.max_restarts})")
    p.add_argument("--startup-timeout", type=float,
                   help="seconds for each worker to reach its first training step (default "
                        f"{DEFAULTS.startup_timeout:g}; 0 disables the check)")
    p.add_argument("--hang-timeout", type=float,
                   help="seconds without a finished training step before the workers' "
                        "watchdogs stop them (default: the strategy's, 600)")
    p.add_argument("--slot-failures", type=int,
                   help="failed attempts in a row that drop a worker slot, with -n MIN:MAX "
                        f"(default {DEFAULTS.slot_failures})")
    p.add_argument("--rejoin-interval", type=float,
                   help="seconds before a dropped slot or missing host is tried again "
                        f"(default {DEFAULTS.rejoin_interval:g})")
    p.add_argument("--grace-period", type=float,
                   help="seconds between SIGTERM and SIGKILL when stopping "
                        f"(default {DEFAULTS.grace_period:g})")
    p.add_argument("--timeout", type=float, help="limit for the whole launch in seconds")
    p.add_argument("--summary-file", help="write a JSON summary of the attempts here")
    p.add_argument("--log-dir", help="directory for every worker's complete output, one file "
                                     "per worker and attempt (default: a new temporary one)")
    p.add_argument("--verbose", action="store_true", default=None,
                   help="show every line of every worker, TensorFlow's start-up notices and "
                        "repeated lines included (also TF_DISTRIB_VERBOSE=1)")
    p.add_argument("--preload", action="store_true", default=None,
                   help="fork workers (and restarts) from a process that has already "
                        "imported TensorFlow and Keras: seconds faster per worker; not for "
                        "scripts that set environment variables before importing TensorFlow "
                        "(also TF_DISTRIB_PRELOAD=1)")
    p.add_argument("--config", help="job file (YAML or JSON); flags override it")
    p.add_argument("--hosts", help="static multi-host launch: comma-separated host[:port] "
                                   "list, identical on every host")
    p.add_argument("--host-index", type=int, help="this host's position in --hosts")
    p.add_argument("--base-port", type=int,
                   help=f"first port of each host (default {DEFAULTS.base_port})")
    p.add_argument("--min-hosts", type=int,
                   help="with --hosts: the fewest hosts an attempt may start with (elastic; "
                        "default: all)")
    p.add_argument("--rendezvous-timeout", type=float,
                   help="seconds an elastic multi-host attempt waits for missing hosts "
                        f"(default {DEFAULTS.rendezvous_timeout:g})")
    p.add_argument("-m", dest="module", help="run a module instead of a script")
    p.add_argument("script", nargs="?", help="training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _job_from_args(options) -> JobConfig:
    job = load_job_file(options.config) if options.config else JobConfig()
    if options.module and options.script:
        # With -m, what argparse took as the script is the module's first argument.
        options.args.insert(0, options.script)
        options.script = None
    overrides = {
        "max_restarts": options.max_restarts, "hang_timeout": options.hang_timeout,
        "grace_period": options.grace_period, "timeout": options.timeout,
        "summary_file": options.summary_file, "host_index": options.host_index,
        "base_port": options.base_port, "script": options.script, "module": options.module,
        "min_hosts": options.min_hosts, "rendezvous_timeout": options.rendezvous_timeout,
        "slot_failures": options.slot_failures, "rejoin_interval": options.rejoin_interval,
        "log_dir": options.log_dir, "verbose": options.verbose,
        "preload": options.preload,
    }
    if options.num_workers is not None:
        overrides["min_workers"], overrides["num_workers"] = parse_worker_range(
            options.num_workers)
    job = dataclasses.replace(job, **{k: v for k, v in overrides.items()
                                      if v is not None or k == "min_workers"})
    if options.module or options.script:
        job.script = options.script
        job.module = options.module
        job.args = list(options.args)
    if options.startup_timeout is not None:
        job.startup_timeout = options.startup_timeout or None
    if options.hosts:
        job.hosts = [h.strip() for h in options.hosts.split(",")]
    return job


def main(argv: list[str] | None = None) -> int:
    """`tf-distrib launch ...`: run the launch; its exit status (2 for bad input)."""
    options = _parser().parse_args(argv)
    try:
        job = _job_from_args(options)
        result = launch(job.target, job.num_workers, args=job.args,
                        min_workers=job.min_workers, max_restarts=job.max_restarts,
                        startup_timeout=job.startup_timeout, hang_timeout=job.hang_timeout,
                        grace_period=job.grace_period, timeout=job.timeout, env=job.env,
                        hosts=job.hosts, host_index=job.host_index, base_port=job.base_port,
                        min_hosts=job.min_hosts, rendezvous_timeout=job.rendezvous_timeout,
                        slot_failures=job.slot_failures,
                        rejoin_interval=job.rejoin_interval, log_dir=job.log_dir,
                        verbose=job.verbose, preload=job.preload)
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
