import json
import socket
import subprocess
import sys

import pytest

from tf_distrib import ClusterConfigError
from tf_distrib.cluster import (
    expand_slurm_nodelist,
    free_ports,
    from_environment,
    local_tf_configs,
    parse_tf_config,
)

W2 = ["127.0.0.1:2222", "127.0.0.1:2223"]


def config(cluster=None, task=None, **extra):
    value = {"cluster": {"worker": W2} if cluster is None else cluster,
             "task": {"type": "worker", "index": 0} if task is None else task}
    value.update(extra)
    return value


def test_valid_worker_cluster():
    spec = parse_tf_config(json.dumps(config(task={"type": "worker", "index": 1})))
    assert spec.workers == W2
    assert spec.chief is None
    assert spec.num_workers == 2
    assert spec.task_type == "worker" and spec.task_index == 1
    assert not spec.is_chief
    assert spec.address == W2[1]
    assert parse_tf_config(spec.to_tf_config()) == spec


def test_chief_cluster():
    spec = parse_tf_config(config(cluster={"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]},
                                  task={"type": "chief", "index": 0}, environment="cloud"))
    assert spec.chief == "h0:1" and spec.num_workers == 3 and spec.is_chief
    assert spec.environment == "cloud"
    worker0 = parse_tf_config(config(cluster={"chief": ["h0:1"], "worker": ["h1:1"]}))
    assert not worker0.is_chief
    assert spec.task == "chief:0" and worker0.task == "worker:0"
    assert spec.training_tasks == ["chief:0", "worker:0", "worker:1"]
    assert spec.training_index == 0 and worker0.training_index == 1


@pytest.mark.parametrize("value, field", [
    ('{"cluster": {"worker": ["a:1"]}, "task": {', "not valid JSON"),
    ('{"cluster": , }', "char 12"),
    ("[1, 2]", "must be a JSON object"),
    (config(bogus=1), "unknown key(s) ['bogus']"),
    ({"task": {"type": "worker", "index": 0}}, "no 'cluster'"),
    ({"cluster": {"worker": W2}}, "no 'task'"),
    (config(cluster={}), "'cluster' is empty"),
    (config(cluster=["a:1"]), "'cluster' must be an object"),
    (config(cluster={"master": ["a:1"]}), "role 'master' is unknown"),
    (config(cluster={"worker": []}), "cluster.worker is an empty list"),
    (config(cluster={"worker": "a:1"}), "cluster.worker must be a list"),
    (config(task={"type": "gpu", "index": 0}), "task.type 'gpu' is unknown"),
    (config(task={"index": 0}), "task.type is missing"),
    (config(task={"type": "chief", "index": 0}), "task.type 'chief' is not a role in cluster"),
    (config(task={"type": "worker", "index": 2}), "task.index is 2"),
    (config(task={"type": "worker", "index": -1}), "task.index is -1"),
    (config(task={"type": "worker", "index": "0"}), "task.index must be an integer"),
    (config(task={"type": "worker", "index": 1.0}), "task.index must be an integer"),
    (config(task={"type": "worker", "index": True}), "task.index must be an integer"),
    (config(task="worker"), "'task' must be an object"),
    (config(cluster={"worker": ["localhost"]}), "cluster.worker[0] is 'localhost', not"),
    (config(cluster={"worker": ["a:b"]}), "cluster.worker[0] has port 'b'"),
    (config(cluster={"worker": ["a:0"]}), "port 0 in 'a:0', outside 1..65535"),
    (config(cluster={"worker": ["a:70000"]}), "outside 1..65535"),
    (config(cluster={"worker": ["bad host:1"]}), "host 'bad host'"),
    (config(cluster={"worker": [2222]}), "cluster.worker[0] must be a \"host:port\""),
    (config(cluster={"worker": ["a:1", "a:1"]}), "cluster.worker[1] repeats address 'a:1'"),
    (config(cluster={"chief": ["a:1", "b:1"], "worker": ["c:1"]}), "only one chief"),
    (config(environment=3), "'environment' must be a string"),
])
def test_invalid_tf_config_names_the_field(value, field):
    with pytest.raises(ClusterConfigError) as error:
        parse_tf_config(value)
    assert field in str(error.value)
    assert isinstance(error.value, ValueError)


def test_roles_a_strategy_cannot_use():
    spec = parse_tf_config(config(cluster={"worker": W2, "ps": ["p:1"]}))
    with pytest.raises(ClusterConfigError, match=r"role\(s\) \['ps'\].*ParameterServerStrategy"):
        spec.check_roles_for("MultiWorkerMirroredStrategy")


def test_ipv6_address_is_accepted():
    assert parse_tf_config(config(cluster={"worker": ["[::1]:2222"]})).address == "[::1]:2222"


def test_from_environment_order():
    tf_config = json.dumps(config())
    vertex = json.dumps({"cluster": {"workerpool0": ["c:2222"], "workerpool1": ["w:2222"]},
                         "task": {"type": "workerpool1", "index": 0}, "environment": "cloud"})
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n1"}
    assert from_environment({}) is None
    assert from_environment({"TF_CONFIG": tf_config, "CLUSTER_SPEC": vertex}).workers == W2
    spec = from_environment({"CLUSTER_SPEC": vertex, **slurm})
    assert (spec.chief, spec.workers, spec.task_type) == ("c:2222", ["w:2222"], "worker")
    assert from_environment(slurm).workers == ["n1:8888"]


def test_expand_slurm_nodelist():
    assert expand_slurm_nodelist("a[1-3,10],b,c[009-010]x") == [
        "a1", "a2", "a3", "a10", "b", "c009x", "c010x"]
    with pytest.raises(ClusterConfigError, match="bad range"):
        expand_slurm_nodelist("a[x-3]")


def test_local_tf_configs():
    configs = local_tf_configs(3)
    workers = configs[0]["cluster"]["worker"]
    assert len(set(workers)) == 3 and all(w.startswith("127.0.0.1:") for w in workers)
    assert [c["task"]["index"] for c in configs] == [0, 1, 2]
    assert all(c["cluster"]["worker"] == workers for c in configs)
    with pytest.raises(ValueError, match="num_workers"):
        local_tf_configs(0)


def test_free_ports_lie_below_the_ephemeral_range_and_bind_on_every_address():
    # A port the kernel may give to an outgoing connection is not free for a server that
    # starts seconds later (Slurm's controller once found its port taken that way).
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(port < ephemeral for port in ports)
    servers = []
    try:
        for port in ports:
            servers.append(socket.create_server(("0.0.0.0", port)))
        # A port held on the wildcard address is not offered again.
        assert not set(free_ports(8)) & set(ports)
    finally:
        for server in servers:
            server.close()
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        free_ports(0)


def test_importing_tf_distrib_does_not_import_tensorflow():
    code = ("import sys, tf_distrib, tf_distrib.cluster, tf_distrib.launch; "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
