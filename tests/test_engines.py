"""The same script under each engine's environment: Kubeflow TFJob, Vertex AI, Slurm.

The environment tests set the variables exactly as each engine does and check the
cluster, the task, the chief and the strategy choice. The end-to-end tests start two
worker processes with those variables and train; the only change from the engine is
that DNS names become 127.0.0.1 (with free ports, as both share one host).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import tf_distrib as td
from tests._slurm import slurm_port_base
from tf_distrib import ClusterConfigError
from tf_distrib.cluster import free_ports, from_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- Kubeflow TFJob -------------------------------------------------------------------

def tfjob_env(replicas, task_type, index, address=None):
    """TF_CONFIG as Kubeflow's training-operator sets it in each pod of a TFJob."""
    address = address or (lambda role, i: f"mnist-{role}-{i}.default.svc:2222")
    cluster = {role: [address(role, i) for i in range(n)] for role, n in replicas.items()}
    return {"TF_CONFIG": json.dumps({"cluster": cluster,
                                     "task": {"type": task_type, "index": index},
                                     "environment": "cloud"})}


def test_tfjob_with_chief():
    replicas = {"chief": 1, "worker": 2}
    specs = [from_environment(tfjob_env(replicas, t, i))
             for t, i in [("chief", 0), ("worker", 0), ("worker", 1)]]
    assert [s.is_chief for s in specs] == [True, False, False]
    assert {s.num_workers for s in specs} == {3}
    assert specs[2].address == "mnist-worker-1.default.svc:2222"
    assert specs[0].chief == "mnist-chief-0.default.svc:2222"
    assert {s.environment for s in specs} == {"cloud"}


def test_tfjob_without_chief_makes_worker_0_the_chief():
    specs = [from_environment(tfjob_env({"worker": 2}, "worker", i)) for i in (0, 1)]
    assert [s.is_chief for s in specs] == [True, False]
    assert specs[0].chief is None and specs[0].num_workers == 2


def test_tfjob_evaluator_runs_outside_the_collective():
    replicas = {"chief": 1, "worker": 1, "evaluator": 1}
    worker = from_environment(tfjob_env(replicas, "worker", 0))
    worker.check_roles_for("MultiWorkerMirroredStrategy")  # the evaluator is allowed
    assert worker.num_workers == 2
    evaluator = from_environment(tfjob_env(replicas, "evaluator", 0))
    assert not evaluator.is_chief
    # The side-car evaluates on its own devices (4 logical CPUs in this process).
    strategy = td.make_strategy(cluster=evaluator)
    assert isinstance(strategy, td.HostMirroredStrategy)
    assert strategy.num_replicas_in_sync == 4


def test_tfjob_errors_name_the_fix():
    with pytest.raises(ClusterConfigError, match="ParameterServerStrategy"):
        td.make_strategy(cluster=from_environment(tfjob_env({"ps": 1, "worker": 2}, "worker", 0)))
    with pytest.raises(ClusterConfigError, match="legacy 'master' is now 'chief'"):
        from_environment(tfjob_env({"master": 1, "worker": 1}, "worker", 0))
    with pytest.raises(ClusterConfigError, match="task.index is 2"):
        from_environment(tfjob_env({"worker": 2}, "worker", 2))
    partial = json.loads(tfjob_env({"worker": 2}, "worker", 0)["TF_CONFIG"])
    del partial["task"]
    with pytest.raises(ClusterConfigError, match="no 'task'"):
        from_environment({"TF_CONFIG": json.dumps(partial)})


# --- Vertex AI ------------------------------------------------------------------------

VERTEX_POOLS = ("workerpool0", "workerpool1", "workerpool2", "workerpool3")
TF_ROLES = ("chief", "worker", "ps", "evaluator")


def vertex_env(pools, pool, index, address=None):
    """CLUSTER_SPEC and TF_CONFIG as Vertex AI sets them on each replica.

    `pools` maps a worker pool to its replica count; Vertex AI names its replicas
    workerpoolN-M and leaves the evaluator (pool 3) out of TF_CONFIG's cluster.
    """
    address = address or (lambda p, i: f"cmle-training-{p}-a1b2c3-{i}:2222")
    cluster = {p: [address(p, i) for i in range(n)] for p, n in pools.items()}
    role = dict(zip(VERTEX_POOLS, TF_ROLES, strict=True))
    tf_cluster = {role[p]: a for p, a in cluster.items() if p != "workerpool3"}
    job = {"worker_pool_specs": [{"replica_count": n} for n in pools.values()]}
    return {
        "CLUSTER_SPEC": json.dumps({"cluster": cluster, "environment": "cloud", "job": job,
                                    "task": {"type": pool, "index": index, "trial": ""}}),
        "TF_CONFIG": json.dumps({"cluster": tf_cluster, "environment": "cloud", "job": job,
                                 "cloud": "a1b2c3",
                                 "task": {"type": role[pool], "index": index, "trial": ""}}),
    }


def test_vertex_chief_and_workers():
    pools = {"workerpool0": 1, "workerpool1": 2}
    for pool, index, task, chief in [("workerpool0", 0, ("chief", 0), True),
                                     ("workerpool1", 1, ("worker", 1), False)]:
        env = vertex_env(pools, pool, index)
        spec = from_environment(env)
        assert (spec.task_type, spec.task_index, spec.is_chief) == (*task, chief)
        assert spec.num_workers == 3
        assert spec.chief == "cmle-training-workerpool0-a1b2c3-0:2222"
        # CLUSTER_SPEC alone (custom containers without TF_CONFIG) gives the same spec.
        assert from_environment({"CLUSTER_SPEC": env["CLUSTER_SPEC"]}) == spec


def test_vertex_evaluator_outside_the_cluster():
    env = vertex_env({"workerpool0": 1, "workerpool1": 1, "workerpool3": 1}, "workerpool3", 0)
    spec = from_environment(env)
    assert (spec.task_type, spec.address, spec.num_workers) == ("evaluator", None, 2)
    assert isinstance(td.make_strategy(cluster=spec), td.HostMirroredStrategy)
    assert from_environment({"CLUSTER_SPEC": env["CLUSTER_SPEC"]}).task_type == "evaluator"


def test_vertex_errors_name_the_fix():
    env = vertex_env({"workerpool0": 1, "workerpool1": 1}, "workerpool1", 0)
    cluster_spec = json.loads(env["CLUSTER_SPEC"])
    with pytest.raises(ClusterConfigError, match="worker pool 'pool9'"):
        from_environment({"CLUSTER_SPEC": json.dumps(
            {**cluster_spec, "cluster": {"pool9": ["a:1"]}})})
    with pytest.raises(ClusterConfigError, match="task.type must name a worker pool"):
        from_environment({"CLUSTER_SPEC": json.dumps({**cluster_spec, "task": {}})})
    with pytest.raises(ClusterConfigError, match="CLUSTER_SPEC .*not valid JSON"):
        from_environment({"CLUSTER_SPEC": "{"})
    with pytest.raises(ClusterConfigError, match="unknown key"):
        from_environment({"TF_CONFIG": json.dumps({**json.loads(env["TF_CONFIG"]), "x": 1})})


# --- Slurm ----------------------------------------------------------------------------

def slurm_env(nodes, tasks_per_node, rank, port_base=None):
    """What `srun` sets in task `rank` of a step with block distribution."""
    node, local = divmod(rank, tasks_per_node)
    nodelist = ",".join(nodes)
    counts = f"{tasks_per_node}(x{len(nodes)})"
    env = {"SLURM_JOB_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": counts,
           "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": counts,
           "SLURM_NTASKS": str(len(nodes) * tasks_per_node), "SLURM_PROCID": str(rank),
           "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
           "SLURMD_NODENAME": nodes[node], "SLURM_STEP_ID": "0"}
    if port_base is not None:
        env["TF_DISTRIB_SLURM_PORT_BASE"] = str(port_base)
    return env


def test_slurm_two_nodes_two_tasks_each():
    specs = [from_environment(slurm_env(["gpu07", "gpu08"], 2, r)) for r in range(4)]
    assert specs[0].workers == ["gpu07:8888", "gpu07:8889", "gpu08:8888", "gpu08:8889"]
    assert [s.task_index for s in specs] == [0, 1, 2, 3]
    assert [s.address for s in specs] == specs[0].workers
    assert [s.is_chief for s in specs] == [True, False, False, False]
    compressed = {**slurm_env(["gpu07", "gpu08"], 2, 3), "SLURM_STEP_NODELIST": "gpu[07-08]"}
    assert from_environment(compressed) == specs[3]


def test_slurm_batch_script_outside_srun_is_not_a_cluster():
    batch = {k: v for k, v in slurm_env(["gpu07", "gpu08"], 2, 0).items()
             if not k.startswith("SLURM_STEP")}
    assert from_environment(batch) is None


def test_slurm_errors_name_the_fix():
    env = slurm_env(["gpu07", "gpu08"], 2, 1)
    with pytest.raises(ClusterConfigError, match="--distribution=block"):
        from_environment({**env, "SLURMD_NODENAME": "gpu08", "SLURM_LOCALID": "0"})  # cyclic
    with pytest.raises(ClusterConfigError, match="describes 1 node"):
        from_environment({**env, "SLURM_STEP_TASKS_PER_NODE": "2"})
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID=4 but the step has 4"):
        from_environment({**env, "SLURM_PROCID": "4"})
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID='x' is not an integer"):
        from_environment({**env, "SLURM_PROCID": "x"})
    with pytest.raises(ClusterConfigError, match="bad entry"):
        from_environment({**env, "SLURM_STEP_TASKS_PER_NODE": "two"})


# --- Two real processes per engine ----------------------------------------------------

def start_and_wait(envs, tmp_path, command=None, timeout=180.0):
    """Runs `command` (default: tests._engine_job) once per environment.

    Returns the exit codes (None for a process still running at `timeout`, then
    killed) and the end of each worker's output.
    """
    base = {k: v for k, v in os.environ.items()
            if k not in ("TF_CONFIG", "CLUSTER_SPEC") and not k.startswith("SLURM")}
    base.update(PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2", TF_DISTRIB_STARTUP_TIMEOUT="90")
    procs = []
    for i, env in enumerate(envs):
        log = open(tmp_path / f"worker{i}.log", "wb")
        procs.append(subprocess.Popen(
            command or [sys.executable, "-m", "tests._engine_job",
                        str(tmp_path / f"worker{i}.json"), str(tmp_path / "backup")],
            env={**base, **env}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            start_new_session=True))
        log.close()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    logs = [(tmp_path / f"worker{i}.log").read_text()[-3000:] for i in range(len(envs))]
    return codes, logs


def run_processes(envs, tmp_path, command=None, timeout=180.0):
    """`start_and_wait`, checking that every worker exits with 0.

    Returns each worker's report (tests._engine_job), or None for other commands.
    """
    codes, logs = start_and_wait(envs, tmp_path, command, timeout)
    assert codes == [0] * len(envs), f"exit codes {codes}:\n" + "\n".join(logs)
    if command:
        return None
    return [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(len(envs))]


def check_trained_together(reports, tasks):
    assert [tuple(r["task"]) for r in reports] == tasks
    assert [r["is_chief"] for r in reports] == [True, False]
    assert {r["strategy"] for r in reports} == {"KerasMultiWorkerMirroredStrategy"}
    assert {r["replicas"] for r in reports} == {2}
    assert {r["iterations"] for r in reports} == {8}  # 256 examples, global batch 32
    assert reports[0]["weights_sha256"] == reports[1]["weights_sha256"]


def loopback(ports):
    return lambda role, i: f"127.0.0.1:{ports[role][i]}"


def tfjob_chief_and_worker_on_loopback():
    """The two pods' environments of a TFJob with one chief and one worker."""
    p = free_ports(2)
    address = loopback({"chief": [p[0]], "worker": [p[1]]})
    replicas = {"chief": 1, "worker": 1}
    return [tfjob_env(replicas, "chief", 0, address), tfjob_env(replicas, "worker", 0, address)]


@pytest.mark.multiprocess
def test_tfjob_chief_and_worker_train(tmp_path):
    reports = run_processes(tfjob_chief_and_worker_on_loopback(), tmp_path)
    check_trained_together(reports, [("chief", 0), ("worker", 0)])


@pytest.mark.multiprocess
def test_tfjob_restart_model_survivor_exits_and_rerun_resumes(tmp_path):
    """TFJob's OnFailure restarts only failed pods: the survivors must fail by themselves."""
    envs = tfjob_chief_and_worker_on_loopback()
    # 3 epochs of 8 steps, a backup every 10 steps; the worker SIGKILLs itself at step 15.
    job = {"ENGINE_JOB_EPOCHS": "3", "ENGINE_JOB_KILL_AT": "15"}
    first = [{**env, **job, "TF_DISTRIB_ATTEMPT": "0", "TF_DISTRIB_WORKER_INDEX": str(i)}
             for i, env in enumerate(envs)]
    start = time.monotonic()
    codes, logs = start_and_wait(first, tmp_path, timeout=120)
    assert codes[1] == -signal.SIGKILL, logs[1]
    # The chief was not told: its gradient transport finds the dead peer at once (TF's
    # heartbeat would, after about 10 s) and the chief exits non-zero, so Kubernetes
    # restarts its pod too.
    assert codes[0] not in (0, None), logs[0]
    assert "PeerLostError: worker:0 (127.0.0.1:" in logs[0], logs[0]
    assert time.monotonic() - start < 100
    # The restarted pods keep their names (here: addresses) and resume from the backup.
    rerun = [{**env, "ENGINE_JOB_EPOCHS": "3", "TF_DISTRIB_ATTEMPT": "1"} for env in envs]
    reports = run_processes(rerun, tmp_path)
    assert [r["restored_step"] for r in reports] == [10, 10]
    assert {r["iterations"] for r in reports} == {24}
    assert reports[0]["weights_sha256"] == reports[1]["weights_sha256"]


@pytest.mark.multiprocess
def test_vertex_chief_and_worker_train(tmp_path):
    p = free_ports(2)
    address = loopback({"workerpool0": [p[0]], "workerpool1": [p[1]]})
    pools = {"workerpool0": 1, "workerpool1": 1}
    reports = run_processes([vertex_env(pools, "workerpool0", 0, address),
                             vertex_env(pools, "workerpool1", 0, address)], tmp_path)
    check_trained_together(reports, [("chief", 0), ("worker", 0)])


@pytest.mark.multiprocess
def test_slurm_two_tasks_on_one_node_train(tmp_path):
    base = slurm_port_base(2)
    reports = run_processes([slurm_env(["127.0.0.1"], 2, r, port_base=base) for r in (0, 1)],
                            tmp_path)
    check_trained_together(reports, [("worker", 0), ("worker", 1)])


# --- The example script and the engines' files in examples/ --------------------------

EXAMPLES = os.path.join(REPO_ROOT, "examples")


@pytest.mark.multiprocess
def test_example_script_trains_under_slurm_and_the_chief_saves_the_model(tmp_path):
    import keras

    command = [sys.executable, os.path.join(EXAMPLES, "train.py"), "--backup-dir",
               str(tmp_path / "backup"), "--model-dir", str(tmp_path / "model"),
               "--epochs", "1", "--examples", "2048"]
    base = slurm_port_base(2)
    run_processes([slurm_env(["127.0.0.1"], 2, r, port_base=base) for r in (0, 1)],
                  tmp_path, command=command)
    model = keras.saving.load_model(tmp_path / "model" / "model.keras")
    assert model.count_params() == 16 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4


def test_engine_files_describe_the_example_job():
    import yaml

    tfjob = yaml.safe_load(open(os.path.join(EXAMPLES, "tfjob.yaml")))
    assert tfjob["kind"] == "TFJob"
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Chief": 1, "Worker": 2}
    for spec in replicas.values():
        assert spec["restartPolicy"] == "OnFailure"
        [container] = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow" and "examples/train.py" in container["command"]
    vertex = yaml.safe_load(open(os.path.join(EXAMPLES, "vertex_job.yaml")))
    pools = vertex["workerPoolSpecs"]
    assert [p["replicaCount"] for p in pools] == [1, 2]
    assert all("examples/train.py" in p["containerSpec"]["command"] for p in pools)
    sbatch = open(os.path.join(EXAMPLES, "train.sbatch")).read()
    assert "srun --kill-on-bad-exit=1 python examples/train.py" in sbatch
    assert subprocess.run(["bash", "-n", os.path.join(EXAMPLES, "train.sbatch")]).returncode == 0
