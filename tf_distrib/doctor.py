"""`tf-distrib doctor`: what a distributed run will see here, and what is wrong with it.

Prints versions, devices, thread settings and the cluster this process would join
(TF_CONFIG, Vertex AI's CLUSTER_SPEC or Slurm), checks that this task's port is free
and which peers answer, and warns about addresses outside loopback and private
ranges (TensorFlow's gRPC has no authentication). Exit status 0 when healthy, 1 with
the problems listed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import socket
import sys

from tf_distrib import __version__, contract
from tf_distrib import cluster as cluster_lib

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _port_free(port: int) -> bool:
    # TensorFlow's server binds 0.0.0.0:<port>, so check exactly that.
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def check(environ=None, devices: bool = True, probe_peers: bool = True,
          rebuild: bool = False) -> tuple[list[str], list[str]]:
    """Returns (report lines, problems).

    Args:
        environ: The environment to read. Defaults to `os.environ`.
        devices: Import TensorFlow to list devices and threads, and build (or find) the
            native ops. Defaults to True.
        probe_peers: Try a TCP connection to each peer's port. Defaults to True.
        rebuild: Build the native ops again, forgetting a remembered failed build.
            Defaults to False.
    """
    env = os.environ if environ is None else environ
    lines, problems = [], []
    tf_package = ("tensorflow-cpu" if _version("tensorflow-cpu") != "not installed"
                  else "tensorflow")
    lines += [f"tf_distrib {__version__}, Python {platform.python_version()}, "
              f"{tf_package} {_version(tf_package)}, keras {_version('keras')}"]
    if devices:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        lines.append(f"devices: {len(tf.config.list_physical_devices('CPU'))} CPU, "
                     f"{len(gpus)} GPU {[g.name for g in gpus] if gpus else ''}".rstrip())
        variables = [f"{v}={env[v]}" for v in _THREAD_VARIABLES if v in env]
        lines.append(f"threads: intra-op {tf.config.threading.get_intra_op_parallelism_threads()}"
                     f", inter-op {tf.config.threading.get_inter_op_parallelism_threads()} "
                     f"(0 = TensorFlow picks), {os.cpu_count()} cores"
                     + (f"; {', '.join(variables)}" if variables else ""))
        from tf_distrib import _compat

        missing = _compat.check()
        lines.append("TensorFlow/Keras internals tf_distrib relies on: "
                     + (f"{len(missing)} missing" if missing else "all present"))
        problems += missing
        lines.append(_native_op(tf, rebuild))
    try:
        spec = cluster_lib.from_environment(env)
    except cluster_lib.ClusterConfigError as e:
        problems.append(f"cluster configuration: {e}")
        return lines, problems
    if spec is None:
        lines.append("cluster: none (no TF_CONFIG, CLUSTER_SPEC or Slurm): "
                     "make_strategy() uses local devices")
        return lines, problems
    lines.append(f"cluster: {spec.num_workers} training task(s), this task "
                 f"{spec.task} "
                 f"{f'at {spec.address}' if spec.address else 'outside the cluster'}"
                 f"{' (chief)' if spec.is_chief else ''}")
    try:
        spec.check_roles_for("MultiWorkerMirroredStrategy")
    except cluster_lib.ClusterConfigError as e:
        problems.append(str(e))
    if spec.address is None:
        lines.append("  a side-car evaluator: make_strategy() uses local devices")
    elif _port_free(port := int(spec.address.rpartition(":")[2])):
        lines.append(f"  port {port}: free")
    else:
        problems.append(f"port {port} of this task is in use: another process (a previous "
                        "run still alive?) holds it; stop it or change the port.")
    for role, addresses in spec.cluster.items():
        for i, address in enumerate(addresses):
            if (role, i) == (spec.task_type, spec.task_index):
                continue
            if not probe_peers:
                state = "not probed"
            elif cluster_lib.is_listening(address):
                state = "reachable"
            else:
                state = "not answering (not started yet?)"
            lines.append(f"  {role}:{i} {address}: {state}")
    public = sorted({a.rpartition(":")[0] for addrs in spec.cluster.values() for a in addrs
                     if not cluster_lib.is_private_address(a.rpartition(":")[0])})
    if public:
        lines.append(f"warning: {public} are not loopback or private addresses. TensorFlow's "
                     "gRPC has no authentication: keep worker ports unreachable from outside "
                     "the job's network (firewall, NetworkPolicy).")
    return lines, problems


def _native_op(tf, rebuild: bool) -> str:
    """Which path the shared-memory transport takes here, and why."""
    from tf_distrib.transport import native_build, native_sum

    if not native_sum.enabled():
        return (f"native ops: off ({contract.ENV_NATIVE_SUM}=0); the shared-memory transport "
                "takes its Python path, PowerSGD TensorFlow's ops")
    try:
        path = native_build.library_path(
            [*tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()],
            tf.__version__, rebuild=rebuild)
        tf.load_op_library(path)
    except (OSError, tf.errors.OpError) as e:
        return (f"native ops: unavailable ({e}); the shared-memory transport takes its "
                "Python path, PowerSGD TensorFlow's ops")
    return f"native ops: {path}; the shared-memory transport and PowerSGD run them"


def main(argv: list[str] | None = None) -> int:
    """`tf-distrib doctor`: print the report; exit status 1 when there are problems."""
    parser = argparse.ArgumentParser(prog="tf-distrib doctor", description=__doc__)
    parser.add_argument("--no-devices", action="store_true",
                        help="skip importing TensorFlow to list devices")
    parser.add_argument("--no-probe", action="store_true",
                        help="do not try to connect to the other tasks' ports")
    parser.add_argument("--rebuild", action="store_true",
                        help="build the native ops again, forgetting a failed build")
    options = parser.parse_args(argv)
    lines, problems = check(devices=not options.no_devices, probe_peers=not options.no_probe,
                            rebuild=options.rebuild)
    print("\n".join(lines))
    if problems:
        print("\nproblems:\n" + "\n".join(f"  - {p}" for p in problems))
        return 1
    print("\nno problems found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
