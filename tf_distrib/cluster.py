"""Cluster configuration: parse and validate TF_CONFIG, Vertex AI and Slurm environments.

Everything here is plain Python (no TensorFlow import) so that the launcher and
`tf-distrib doctor` can validate a cluster in milliseconds, before TensorFlow starts
a gRPC server that would otherwise block forever on a typo.

Example:

```python
spec = tf_distrib.cluster.from_environment()
if spec is not None:
    print(spec.task_type, spec.task_index, "of", spec.num_workers, "workers")
```
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import random
import re
import socket
from collections.abc import Mapping

from tf_distrib._checks import check_int, is_int

__all__ = [
    "ClusterConfigError",
    "ClusterSpec",
    "parse_tf_config",
    "from_environment",
    "local_tf_configs",
    "free_ports",
    "expand_slurm_nodelist",
    "is_listening",
    "is_private_address",
]

# Roles that tf.distribute knows. "chief" and "worker" train under
# MultiWorkerMirroredStrategy; "ps" serves ParameterServerStrategy; "evaluator"
# is a side-car that never joins the collective.
TRAINING_ROLES = ("chief", "worker")
KNOWN_ROLES = TRAINING_ROLES + ("ps", "evaluator")

# Vertex AI numbers its worker pools; for TensorFlow jobs pool 0 is the chief,
# pool 1 the workers, pool 2 parameter servers, pool 3 the evaluator.
_VERTEX_POOLS = {"workerpool0": "chief", "workerpool1": "worker", "workerpool2": "ps",
                 "workerpool3": "evaluator"}

# TensorFlow's SlurmClusterResolver uses this port base; each task on a node
# listens on base + its local index.
SLURM_PORT_BASE = 8888


class ClusterConfigError(ValueError):
    """A cluster configuration is invalid. The message names the field and the fix.

    Example:

    ```python
    try:
        td.cluster.parse_tf_config('{"cluster": {}}')
    except td.ClusterConfigError as e:
        print(e)   # names the problem and the fix
    ```
    """


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A validated cluster and this process's place in it.

    Attributes:
        cluster: Mapping from role ("chief", "worker", "ps", "evaluator") to its
            list of "host:port" addresses.
        task_type: This process's role.
        task_index: This process's index within its role.
        environment: TF_CONFIG's optional "environment" (e.g. "cloud" on Kubeflow).
            Defaults to None.

    Example:

    ```python
    spec = td.cluster.parse_tf_config(os.environ["TF_CONFIG"])
    print(spec.task, spec.num_workers, spec.is_chief)
    ```
    """

    cluster: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int
    environment: str | None = None

    @property
    def workers(self) -> list[str]:
        """Addresses of the "worker" role (the chief, if any, is not included)."""
        return list(self.cluster.get("worker", ()))

    @property
    def chief(self) -> str | None:
        """Address of the chief, or None when the cluster has no "chief" role."""
        chiefs = self.cluster.get("chief", ())
        return chiefs[0] if chiefs else None

    @property
    def num_workers(self) -> int:
        """Number of processes that train: workers plus the chief."""
        return sum(len(self.cluster.get(role, ())) for role in TRAINING_ROLES)

    @property
    def task(self) -> str:
        """This process's task name, "role:index" (e.g. "worker:1")."""
        return f"{self.task_type}:{self.task_index}"

    @property
    def training_tasks(self) -> list[str]:
        """The task names of the processes that train, the chief's first."""
        return [f"{role}:{i}" for role in TRAINING_ROLES
                for i in range(len(self.cluster.get(role, ())))]

    @property
    def training_index(self) -> int:
        """This task's position among `training_tasks` (its rank in the collectives).

        Raises:
            ValueError: this task does not train (an evaluator).
        """
        return self.training_tasks.index(self.task)

    @property
    def is_chief(self) -> bool:
        """Whether this task saves checkpoints and writes summaries.

        That is the "chief" task or, in a cluster without one, worker 0, the same
        rule as tf.distribute's.
        """
        if self.task_type == "chief":
            return True
        return self.chief is None and self.task_type == "worker" and self.task_index == 0

    @property
    def address(self) -> str | None:
        """This task's own "host:port" (None for an evaluator outside the cluster)."""
        addresses = self.cluster.get(self.task_type)
        return addresses[self.task_index] if addresses else None

    def to_tf_config(self) -> dict:
        """Returns the TF_CONFIG dictionary that describes this spec."""
        config = {
            "cluster": {role: list(addrs) for role, addrs in self.cluster.items()},
            "task": {"type": self.task_type, "index": self.task_index},
        }
        if self.environment:
            config["environment"] = self.environment
        return config

    def check_roles_for(self, strategy_name: str) -> None:
        """Raises ClusterConfigError if the cluster has roles `strategy_name` cannot use.

        MultiWorkerMirroredStrategy trains on "chief" and "worker" tasks; an
        "evaluator" (Kubeflow's Evaluator, Vertex AI's pool 3) may be listed, as
        tf.distribute leaves it out of the collective. "ps" tasks cannot be used.
        """
        unusable = sorted(set(self.cluster) - set(TRAINING_ROLES) - {"evaluator"})
        if unusable:
            raise ClusterConfigError(
                f"TF_CONFIG cluster has role(s) {unusable}, which {strategy_name} cannot "
                "use: it trains on 'chief' and 'worker' tasks only. Remove the "
                f"{unusable} entries, or use tf.distribute.ParameterServerStrategy."
            )


def parse_tf_config(value: str | Mapping) -> ClusterSpec:
    """Parses and validates a TF_CONFIG value.

    Args:
        value: The TF_CONFIG as a JSON string or an already decoded dict.

    Returns:
        The validated `ClusterSpec`.

    Raises:
        ClusterConfigError: naming the offending field and how to fix it.

    Example:

    >>> spec = parse_tf_config('{"cluster": {"worker": ["127.0.0.1:2222", '
    ...     '"127.0.0.1:2223"]}, "task": {"type": "worker", "index": 1}}')
    >>> spec.num_workers, spec.is_chief
    (2, False)
    """
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ClusterConfigError(
                f"TF_CONFIG is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                f"(char {e.pos}). Write it as JSON, e.g. "
                '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
                '"task": {"type": "worker", "index": 0}}'
            ) from None
    if not isinstance(value, Mapping):
        raise ClusterConfigError(
            f"TF_CONFIG must be a JSON object with 'cluster' and 'task', got "
            f"{type(value).__name__}."
        )
    # "job" and "cloud" are Vertex AI / AI Platform additions that TF ignores.
    unknown = sorted(set(value) - {"cluster", "task", "environment", "rpc_layer", "job",
                                   "cloud"})
    if unknown:
        raise ClusterConfigError(
            f"TF_CONFIG has unknown key(s) {unknown}; allowed keys are 'cluster', 'task', "
            "'environment' and 'rpc_layer' (and Vertex AI's 'job' and 'cloud')."
        )
    cluster = _parse_cluster(value.get("cluster"))
    task_type, task_index = _parse_task(value.get("task"), cluster)
    environment = value.get("environment")
    if environment is not None and not isinstance(environment, str):
        raise ClusterConfigError(
            f"TF_CONFIG 'environment' must be a string (e.g. \"cloud\"), got {environment!r}."
        )
    return ClusterSpec(cluster=cluster, task_type=task_type, task_index=task_index,
                       environment=environment)


def _parse_cluster(cluster) -> dict[str, tuple[str, ...]]:
    if cluster is None:
        raise ClusterConfigError(
            "TF_CONFIG has no 'cluster'; add e.g. "
            '"cluster": {"worker": ["host1:2222", "host2:2222"]}.'
        )
    if not isinstance(cluster, Mapping):
        raise ClusterConfigError(
            f"TF_CONFIG 'cluster' must be an object mapping roles to address lists, got "
            f"{type(cluster).__name__}."
        )
    if not cluster:
        raise ClusterConfigError(
            "TF_CONFIG 'cluster' is empty; list at least one role, e.g. "
            '{"worker": ["host1:2222"]}.'
        )
    parsed = {}
    seen = {}
    for role, addresses in cluster.items():
        if role not in KNOWN_ROLES:
            hint = " (Kubeflow's legacy 'master' is now 'chief')" if role == "master" else ""
            raise ClusterConfigError(
                f"TF_CONFIG cluster role '{role}' is unknown{hint}; roles are "
                f"{', '.join(KNOWN_ROLES)}."
            )
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
            raise ClusterConfigError(
                f"TF_CONFIG cluster.{role} must be a list of \"host:port\" strings, got "
                f"{addresses!r}."
            )
        if not addresses:
            raise ClusterConfigError(
                f"TF_CONFIG cluster.{role} is an empty list; give its addresses or remove it."
            )
        for i, address in enumerate(addresses):
            field = f"cluster.{role}[{i}]"
            _check_address(address, field)
            if address in seen:
                raise ClusterConfigError(
                    f"TF_CONFIG {field} repeats address {address!r} of {seen[address]}; "
                    "every task needs its own host:port."
                )
            seen[address] = field
        parsed[role] = tuple(addresses)
    if len(parsed.get("chief", ())) > 1:
        raise ClusterConfigError(
            f"TF_CONFIG cluster.chief has {len(parsed['chief'])} addresses; there can be only "
            "one chief. Move the others to cluster.worker."
        )
    if len(parsed.get("evaluator", ())) > 1:
        raise ClusterConfigError(
            "TF_CONFIG cluster.evaluator has more than one address; there can be only one."
        )
    return parsed


def _check_address(address, field: str) -> None:
    if not isinstance(address, str):
        raise ClusterConfigError(
            f"TF_CONFIG {field} must be a \"host:port\" string, got {address!r}."
        )
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port:
        raise ClusterConfigError(
            f"TF_CONFIG {field} is {address!r}, not \"host:port\"; write e.g. "
            "\"10.0.0.2:2222\"."
        )
    if not port.isdigit():
        raise ClusterConfigError(
            f"TF_CONFIG {field} has port {port!r} in {address!r}; the port must be a number "
            "from 1 to 65535."
        )
    if not 1 <= int(port) <= 65535:
        raise ClusterConfigError(
            f"TF_CONFIG {field} has port {port} in {address!r}, outside 1..65535."
        )
    if not re.fullmatch(r"[A-Za-z0-9._:\-]+", host):
        raise ClusterConfigError(
            f"TF_CONFIG {field} has host {host!r} in {address!r}, which is not a host name "
            "or IP address."
        )


def _parse_task(task, cluster) -> tuple[str, int]:
    if task is None:
        raise ClusterConfigError(
            "TF_CONFIG has no 'task'; add e.g. \"task\": {\"type\": \"worker\", \"index\": 0} "
            "(a different index on each worker)."
        )
    if not isinstance(task, Mapping):
        raise ClusterConfigError(
            f"TF_CONFIG 'task' must be an object with 'type' and 'index', got {task!r}."
        )
    task_type = task.get("type")
    if task_type is None:
        raise ClusterConfigError(
            "TF_CONFIG task.type is missing; set it to one of the roles in 'cluster', "
            f"{sorted(cluster)}."
        )
    if task_type not in KNOWN_ROLES:
        raise ClusterConfigError(
            f"TF_CONFIG task.type '{task_type}' is unknown; use one of {', '.join(KNOWN_ROLES)}."
        )
    index = task.get("index", 0)
    if not is_int(index):
        raise ClusterConfigError(
            f"TF_CONFIG task.index must be an integer, got {index!r}."
        )
    if task_type == "evaluator" and task_type not in cluster:
        # Vertex AI leaves its evaluator out of the cluster: it is not part of training.
        return task_type, index
    if task_type not in cluster:
        raise ClusterConfigError(
            f"TF_CONFIG task.type '{task_type}' is not a role in cluster ({sorted(cluster)}); "
            f"add cluster.{task_type} or fix task.type."
        )
    size = len(cluster[task_type])
    if not 0 <= index < size:
        raise ClusterConfigError(
            f"TF_CONFIG task.index is {index}, but cluster.{task_type} has {size} "
            f"address(es): use an index from 0 to {size - 1}."
        )
    return task_type, index


def spec_of(strategy) -> ClusterSpec:
    """The `ClusterSpec` of a MultiWorkerMirroredStrategy, from its cluster resolver."""
    resolver = strategy.cluster_resolver
    return ClusterSpec({role: tuple(addresses) for role, addresses
                        in resolver.cluster_spec().as_dict().items()},
                       resolver.task_type, resolver.task_id)


def from_environment(environ: Mapping[str, str] | None = None) -> ClusterSpec | None:
    """Reads the cluster from the environment: TF_CONFIG, else Vertex AI, else Slurm.

    - TF_CONFIG, as Kubeflow's TFJob, Ray Train, Vertex AI and `tf-distrib launch`
      set it (Vertex AI's extra keys "job" and "cloud", and an evaluator task left
      out of the cluster, are accepted).
    - Vertex AI's CLUSTER_SPEC, when TF_CONFIG is absent: worker pool 0 is the chief,
      1 the workers, 2 parameter servers, 3 the evaluator.
    - Inside an `srun` step (SLURM_PROCID, SLURM_STEP_NODELIST,
      SLURM_STEP_TASKS_PER_NODE): one worker per task, at node:8888 + its local task
      index (TF_DISTRIB_SLURM_PORT_BASE changes 8888), like TF's
      SlurmClusterResolver. Ranks must fill the nodes in order (Slurm's default
      block distribution). A batch script outside `srun` is a single process, not
      a cluster.

    Args:
        environ: The environment to read. Defaults to `os.environ`.

    Returns:
        The validated `ClusterSpec`, or None when no cluster is configured.

    Raises:
        ClusterConfigError: when a cluster is configured but invalid.

    Example:

    ```python
    spec = td.cluster.from_environment()
    if spec is None:
        print("no cluster: make_strategy() uses this process's devices")
    ```
    """
    env = os.environ if environ is None else environ
    tf_config = env.get("TF_CONFIG", "").strip()
    if tf_config:
        return parse_tf_config(tf_config)
    cluster_spec = env.get("CLUSTER_SPEC", "").strip()
    if cluster_spec:
        return _from_vertex_cluster_spec(cluster_spec)
    # Only an srun step is a cluster: the batch script itself is one process,
    # although it sees the job's node list.
    if "SLURM_PROCID" in env and "SLURM_STEP_NODELIST" in env:
        return _from_slurm(env)
    return None


def _from_vertex_cluster_spec(value: str) -> ClusterSpec:
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(
            f"CLUSTER_SPEC (Vertex AI) is not valid JSON: {e.msg} at char {e.pos}."
        ) from None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("cluster"), Mapping):
        raise ClusterConfigError(
            "CLUSTER_SPEC (Vertex AI) must be an object with 'cluster' (worker pools) and "
            "'task'."
        )
    cluster = {}
    for pool, addresses in spec["cluster"].items():
        if pool not in _VERTEX_POOLS:
            raise ClusterConfigError(
                f"CLUSTER_SPEC has worker pool '{pool}'; Vertex AI pools are "
                f"{', '.join(_VERTEX_POOLS)}."
            )
        cluster[_VERTEX_POOLS[pool]] = addresses
    task = spec.get("task")
    if not isinstance(task, Mapping) or task.get("type") not in _VERTEX_POOLS:
        raise ClusterConfigError(
            "CLUSTER_SPEC task.type must name a worker pool (workerpool0..3), got "
            f"{task!r}."
        )
    return parse_tf_config({
        "cluster": cluster,
        "task": {"type": _VERTEX_POOLS[task["type"]], "index": task.get("index", 0)},
        "environment": spec.get("environment", "cloud"),
    })


def _from_slurm(env: Mapping[str, str]) -> ClusterSpec:
    nodelist = env["SLURM_STEP_NODELIST"]
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "1")
    hosts = expand_slurm_nodelist(nodelist)
    counts = _expand_slurm_counts(tasks_per_node)
    if len(counts) != len(hosts):
        raise ClusterConfigError(
            f"Slurm: SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} describes {len(counts)} "
            f"node(s) but the node list {nodelist!r} has {len(hosts)}."
        )
    port_base = _int_env(env, "TF_DISTRIB_SLURM_PORT_BASE", SLURM_PORT_BASE)
    tasks = [(host, local) for host, n in zip(hosts, counts, strict=True)
             for local in range(n)]
    rank = _int_env(env, "SLURM_PROCID", 0)
    if not 0 <= rank < len(tasks):
        raise ClusterConfigError(
            f"Slurm: SLURM_PROCID={rank} but the step has {len(tasks)} task(s) "
            f"({nodelist!r}, {tasks_per_node!r})."
        )
    # Peers can only compute each other's addresses if ranks fill the nodes in
    # order: Slurm's default block distribution. A cyclic one would make every
    # worker wait for peers at the wrong address.
    host, local = tasks[rank]
    node, local_id = env.get("SLURMD_NODENAME"), env.get("SLURM_LOCALID")
    if (node is not None and node != host) or (local_id is not None and local_id != str(local)):
        raise ClusterConfigError(
            f"Slurm: task {rank} runs on {node}, local task {local_id}, but block "
            f"distribution puts it on {host}, local task {local}. Launch with "
            "`srun --distribution=block` (Slurm's default)."
        )
    return parse_tf_config({"cluster": {"worker": [f"{h}:{port_base + i}" for h, i in tasks]},
                            "task": {"type": "worker", "index": rank}})


def _int_env(env, name, default):
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ClusterConfigError(f"{name}={raw!r} is not an integer.") from None


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expands a Slurm node list such as "gpu[01-03,7],login1" into host names.

    Args:
        nodelist: The compressed list, as in SLURM_JOB_NODELIST.

    Returns:
        The host names, in Slurm's order.

    Example:

    ```python
    td.cluster.expand_slurm_nodelist("node[01-02],gpu7")   # ["node01", "node02", "gpu7"]
    ```
    """
    hosts = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", nodelist):
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ClusterConfigError(f"Slurm node list {nodelist!r} has bad range {part!r}.")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}{suffix}")
    if not hosts:
        raise ClusterConfigError(f"Slurm node list {nodelist!r} names no node.")
    return hosts


def _expand_slurm_counts(value: str) -> list[int]:
    # Slurm writes repeated counts as "2(x3),1" meaning 2,2,2,1.
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ClusterConfigError(f"Slurm tasks-per-node {value!r} has bad entry {part!r}.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _first_ephemeral_port() -> int:
    """Where the range starts that the kernel hands to outgoing connections and port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Returns `n` distinct TCP ports that are free on every address of this machine now.

    The ports lie below the kernel's ephemeral range: a port from that range could be
    given to any outgoing connection between this check and the moment a server binds
    it (a worker starting TensorFlow takes seconds), one below it only to another
    listener. Each is checked by binding the wildcard address, as TensorFlow's gRPC
    server and Slurm's daemons bind.

    Args:
        n: How many ports. Must be >= 1.
        host: Selects the address family: IPv6 when it contains ":". Defaults to
            "127.0.0.1".

    Returns:
        `n` distinct port numbers.

    Example:

    ```python
    a, b = free_ports(2)
    ```
    """
    check_int("n", n)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
    top = _first_ephemeral_port()
    below = range(max(1024, top - 16384), top)
    # Its own generator: the caller's `random` sequence (a seeded notebook) stays as it was.
    candidates = random.SystemRandom().sample(below, min(64 * n, len(below)))
    sockets: list[socket.socket] = []
    try:
        for port in [*candidates, *[0] * n]:  # the kernel's choice when all are taken
            if len(sockets) == n:
                break
            s = socket.socket(family)
            try:
                s.bind((wildcard, port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < n:
            raise OSError(f"found {len(sockets)} of {n} free TCP ports on this machine; "
                          "close the servers that hold them or pass ports explicitly")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def local_tf_configs(num_workers: int, host: str = "127.0.0.1",
                     ports: list[int] | None = None) -> list[dict]:
    """Builds one TF_CONFIG per worker for a cluster on one host.

    Worker 0 is the chief (tf.distribute's rule for clusters without a "chief" role).

    Args:
        num_workers: How many workers. Must be >= 1.
        host: The address every worker binds to. Defaults to "127.0.0.1": TensorFlow's
            gRPC server has no authentication, so keep it on loopback unless the
            network is private to the job.
        ports: The ports to use, one per worker. Defaults to free ports found now.

    Returns:
        A list of `num_workers` TF_CONFIG dicts (JSON-encode them for the environment).

    Example:

    ```python
    configs = td.cluster.local_tf_configs(2)
    os.environ["TF_CONFIG"] = json.dumps(configs[0])   # this process is worker 0
    ```
    """
    check_int("num_workers", num_workers)
    ports = free_ports(num_workers, host) if ports is None else list(ports)
    if len(ports) != num_workers:
        raise ValueError(f"Got {len(ports)} ports for {num_workers} workers.")
    bracketed = f"[{host}]" if ":" in host else host
    workers = [f"{bracketed}:{port}" for port in ports]
    configs = [{"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
               for i in range(num_workers)]
    for config in configs:
        parse_tf_config(config)
    return configs


def is_listening(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at "host:port" within `timeout` seconds.

    Args:
        address: "host:port".
        timeout: Seconds to wait for the connection. Defaults to 1.

    Example:

    ```python
    td.cluster.is_listening("127.0.0.1:2222", timeout=0.5)
    ```
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def is_private_address(host: str) -> bool:
    """Whether `host` is loopback or in a private range (where unauthenticated gRPC is ok).

    Example:

    ```python
    td.cluster.is_private_address("10.0.0.5")   # True
    ```
    """
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == "localhost"
    return ip.is_loopback or ip.is_private
