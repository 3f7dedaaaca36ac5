"""Several nodes for real: the job scripts of `examples/cluster` and the strategies' faults on an
emulated cluster of 2 nodes x 2 workers.

The cluster (`lightning_prague.tools.cluster`) makes each node a network namespace with its own host name and a
Debian-style ``/etc/hosts`` (the node's own name on 127.0.1.1, the other node at its bridge
address), joined by 1 Gbit/s links shaped with ``tc``; gloo is told each node's interface
(``GLOO_SOCKET_IFNAME``), as on any machine with more than one. Each node's processes are started
inside it and both nodes' at the same time; every rank of a job must end its fit with the same
model.

What runs (about a minute on two cores):

- **The example job scripts** (`examples/cluster`), each as its launcher runs it, the same
  ``train.py`` for 2 epochs, at once:
  - ``slurm.sbatch`` (``partial_reduce``), run on each node as ``sbatch`` would with SLURM's batch
    variables and an emulated ``srun`` on its ``PATH`` (`lightning_prague.tools.cluster.batch`)
    that starts the node's 2 tasks, forked from one import of Lightning (``--preload``); its store
    and control plane are a plane service (``lightning-prague plane``) on node2, not on rank 0's
    node1, as on preemptible nodes;
  - ``torchrun.sh`` (``adpsgd``), one torchrun agent per node, rendezvous at node1 (c10d),
    one worker per node (fresh interpreters: the costliest start here);
  - ``kubernetes.yaml`` (``decent_adam``), one pod per node: each pod's container command with the
    environment its manifest gives it, the completion index as ``NODE_RANK`` and the cluster's own
    names and sizes where a real cluster's differ (`pod_environment`); its store and control plane
    are ``plane.yaml``'s plane service on node2, and its pods have ``LIGHTNING_PRAGUE_PLANE``
    uncommented, as ``plane.yaml`` says;
  Every launcher exits 0, every rank reports the end of the fit with one model, and the job's root
  directory holds the last checkpoint, the ``workers/live`` metric and the supervisor's log. Each
  example restarts a lost worker through ``train.py --max-restarts`` (its keeper); in two of them a
  rank is lost once the first epoch is over (`lose_a_rank`): torchrun's rank 0 training process (on
  the node of the control plane, which lives in a process of its own) is killed once its keeper's
  warm spare is warm (its CPU time stands still: imports done), and the spare rejoins as its new
  process; Kubernetes' pod 0 (rank 0: on the plane service, like any other) is lost and a
  replacement pod with the same index (nothing kept; its interpreter warm, `GATED_POD`) rejoins;
  both train again and finish with the others' model.
- **srun-style jobs of the demo** (``lightning_prague.tools.cluster.srun``, forked from one import):
  - ``prague`` with ``max_workers=6``: rank 2 kills itself, a new process with its old SLURM
    variables as a new step of the job (``SLURM_STEP_ID=1``, ``LIGHTNING_PRAGUE_REJOIN=1``) rejoins,
    and ranks 4 and 5 join (from the start, with the examples). The cut below is short for it (a
    15 s bound): every rank finishes;
  - ``decent_adam`` **cut off**: its store and control plane are a plane service on node2
    (``--plane``); once the examples are over, its ranks start, and node1's link (rank 0's node) is
    cut for ``CUT_SECONDS`` (10 s), beyond its 3 s detection bound: node1's ranks are counted lost,
    node2's finish with one model, and node1's fence themselves (exit status 75, a message that
    says they were cut off): rank 0's node is lost like any other. It starts after the examples, so
    that the cut touches none of them.

``LPC_CLUSTER_ALL=1`` also runs every strategy's demo both ways, torchrun and srun-style.

Plus checks of the tool itself: hosts and host names, shaping, cut and heal, the tear-down.
Skipped with the reason when this machine cannot create network namespaces (not root, no ``ip``).
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from helpers import IdleProcesses, keeper_children, run_forked

from lightning_prague.strategies.keeper import SPARE_VARIABLE
from lightning_prague.tools.cluster import Cluster, ClusterUnavailable, clean_environment
from lightning_prague.tools.cluster.batch import batch_environment, write_srun
from lightning_prague.tools.cluster.emulate import cluster_ids, namespaces
from lightning_prague.tools.cluster.srun import Layout, task_environment

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "cluster"

#: Not `serial` (under pytest-xdist the other worker goes on beside these jobs): their lost ranks' new
#: processes start from warm spares (torchrun's rank 0 is killed once its spare is idle), a replacement
#: pod waits warm behind its gate, and the fits last long enough for a cold start beside another module
pytestmark = [pytest.mark.timeout(240)]

STRATEGIES = ("prague", "partial_reduce", "adpsgd", "decent_adam")
EVERY_WAY = bool(os.environ.get("LPC_CLUSTER_ALL"))  # every strategy's demo on both launch paths too
TORCHRUN = STRATEGIES if EVERY_WAY else ()
#: the strategy of the torchrun job in replica groups of a node (each node's two ranks one synchronous
#: replica; `decent_adam` goes at each replica's own pace there, from the work queue): issue 50's launch
REPLICAS = "decent_adam"
#: the srun-style job whose ranks on node2 are cut off for longer than its detection bound
PARTITIONED = "decent_adam"
SRUN = STRATEGIES if EVERY_WAY else (PARTITIONED,)
#: node1's link is down this long once the partitioned job's ranks have set up: longer than its
#: detection bound (`PARTITION_HANG` s, or 5 times its longest recent step if longer, as a loaded
#: machine may stretch them), well under every other job's (`HANG` s), whose cut is short
CUT_SECONDS = 10.0
PARTITION_HANG, HANG = 3.0, 30.0
#: the partitioned job's plane service, on node2: node1, where its rank 0 runs, is the node cut off
PARTITION_PLANE_PORT = 29641
NODES, WORKERS = 2, 2
#: a test prefix of our own, so that a left-over check never mistakes another user's cluster for ours
PREFIX = "lpcltest-"
#: the most seconds one job may take before its processes are killed and it fails
JOB_TIMEOUT = 150
#: the srun-style job whose rank 2 is killed (SIGKILL at its 20th batch) and started again with its
#: old environment, and which two more workers join as ranks 4 and 5 (`max_workers=6`)
REJOIN, REJOIN_EPOCHS = "prague", 12
#: each example's launcher and strategy: with the rejoin job's prague every strategy finishes a fit
#: on several nodes (2 workers, one per node, are too few for partial_reduce's default group size)
EXAMPLE_STRATEGIES = {"slurm": "partial_reduce", "torchrun": "adpsgd", "kubernetes": "decent_adam"}
#: the examples that lose a rank once their first epoch is over, and the rank, each lost as its
#: launcher loses one: torchrun's rank 0 training process is killed (its keeper starts it again; the control
#: plane, a process of its own, lives on), Kubernetes' pod 0 is lost (a replacement pod with the same
#: index, nothing kept, starts: the plane service on node2 lives on); their fits last long enough for
#: the new process to rejoin and train
LOST_RANK = {"torchrun": 0, "kubernetes": 0}
#: (torchrun's rank 0 is killed once its keeper's spare is warm: killed while the spare still imported, it came
#: back 15-20 s later, and the survivor, at 0.4 s an epoch, had finished 55 epochs before it trained a batch)
EXAMPLE_EPOCHS = {"slurm": 2, "torchrun": 150, "kubernetes": 28}
#: the job scripts that make a secret file per job in its root directory (slurm's is given the plane's)
SECRET_FILES = ("torchrun",)
#: the examples whose store and control plane are a plane service on the second node, at this port
PLANE_SERVICE, PLANE_PORT = ("slurm", "kubernetes"), 29631
#: the port of the Kubernetes example's plane service (`plane.yaml`'s), on the second node
MANIFEST_PLANE_PORT = 29400
#: the Kubernetes Secret's value, as `kubectl create secret` made it for the manifest's job
JOB_SECRET = "a-secret-made-for-one-job-by-kubectl"


@pytest.fixture(scope="module")
def cluster():
    """2 nodes on 1 Gbit/s links; skips when namespaces cannot be created here."""
    try:
        built = Cluster(NODES, rate="1gbit", prefix=PREFIX).start()
    except ClusterUnavailable as why:
        pytest.skip(f"no emulated cluster on this machine: {why}")
    with built:
        yield built


def demo_args(
    strategy: str, out: Path, partitioned: bool = False, rejoin: bool = False, replicas: bool = False
) -> list[str]:
    """The demo's options for one short job of ``strategy`` on the cluster; the partitioned one with a
    detection bound under the cut; the rejoin job long enough for a killed rank and two new workers
    to join it (`REJOIN_EPOCHS`); `replicas`: in replica groups of a node."""
    timing = ["--epochs", "1", "--step-time", "0.02", "--hang-timeout", str(HANG)]
    if replicas:
        timing += ["--replica-size", "node"]
    if rejoin:  # silent bound max(10 s, 150 x 0.1 s)
        timing = ["--epochs", str(REJOIN_EPOCHS), "--step-time", "0.1", "--hang-timeout", str(HANG)]
        timing += ["--hang-factor", "150", "--profile", "homogeneous", "--fault", "2:20:kill", "--max-workers", "6"]
    elif partitioned:  # its store and control plane: a plane service on node2 (`PARTITION_PLANE`)
        timing = ["--epochs", "6", "--step-time", "0.05", "--hang-timeout", str(PARTITION_HANG), "--hang-factor", "5"]
        timing += ["--profile", "homogeneous", "--plane", f"node2:{PARTITION_PLANE_PORT}"]
    return [
        "--strategy", strategy, "--devices", str(WORKERS), "--num-nodes", str(NODES), *timing,
        "--grouping-timeout", "60", "--json", str(out),
    ]  # fmt: skip


def node_env(node, directory: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A node's environment: its interface for gloo (and NCCL), one thread, ``TMPDIR`` in the job's
    directory, and this interpreter's ``bin`` first on ``PATH`` (``python``, ``torchrun``)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
    env = {"GLOO_SOCKET_IFNAME": node.ifname, "NCCL_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1"}
    return clean_environment({**env, "TMPDIR": str(directory), "PATH": path, **(extra or {})})


def wait(procs: list[subprocess.Popen], deadline: float) -> list[int | None]:
    """Exit codes (``None``: still running at the deadline, then killed with its session)."""
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append(None)
    return codes


def tail(paths: list[Path], chars: int = 2500) -> str:
    """The end of every file of ``paths``, for a failure's message."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in paths if p.is_file())


# -- the example job scripts


@dataclass
class Example:
    """One example job script's job: where it writes, its processes (launchers, agents or pods)."""

    launcher: str
    directory: Path
    world: int = NODES * WORKERS
    procs: list[subprocess.Popen] = field(default_factory=list)
    #: processes that serve the job until it ends (a plane service), stopped then
    services: list[subprocess.Popen] = field(default_factory=list)
    codes: list[int | None] = field(default_factory=list)
    lost: str = ""  # how its rank was lost (`lose_a_rank`), or why that did not happen

    @property
    def strategy(self) -> str:
        return EXAMPLE_STRATEGIES[self.launcher]

    @property
    def epochs(self) -> int:
        return EXAMPLE_EPOCHS[self.launcher]

    @property
    def root_dir(self) -> Path:
        """``--root-dir`` of train.py: checkpoints, metrics, the supervisor's log."""
        return self.directory / "runs"

    def log(self, name: str) -> Path:
        return self.directory / f"{self.launcher}-{name}.log"

    def logs(self) -> list[Path]:
        return sorted(self.directory.glob("*.log")) + sorted(self.root_dir.glob("lightning_prague_logs/*"))

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.directory.glob("*.log")))

    def start(self, cluster: Cluster, node, argv: list[str], env: dict[str, str], name: str = "") -> None:
        with open(self.log(name or node.name), "w") as log:  # the process keeps its own copy
            self.procs.append(cluster.run(node, argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))


def train_args(example: Example) -> list[str]:
    """What the test adds to each example's train.py command line: its strategy, a short fit, the CPU."""
    return ["--strategy", example.strategy, "--max-epochs", str(example.epochs), "--accelerator", "cpu"]


def start_plane_service(
    cluster: Cluster, node, directory: Path, port: int, services: list[subprocess.Popen]
) -> dict[str, str]:
    """A plane service (`lightning-prague plane`) on `node` at `port`, logging in `directory`, with a
    secret file of the job's made for it (appended to `services`); returns what a job's environment
    needs to use it (its address and the secret's file)."""
    secret = directory / "plane-secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    env = node_env(node, directory, {"LIGHTNING_PRAGUE_SECRET_FILE": str(secret)})
    argv = [sys.executable, "-m", "lightning_prague.cli", "plane", "--port", str(port), "--control-port", str(port + 1)]
    argv += ["--log-dir", str(directory / "plane")]
    with open(directory / f"plane-{node.name}.log", "w") as log:
        services.append(cluster.run(node, argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    return {"LIGHTNING_PRAGUE_PLANE": f"{node.name}:{port}", "LIGHTNING_PRAGUE_SECRET_FILE": str(secret)}


def start_slurm(cluster: Cluster, example: Example) -> None:
    """``slurm.sbatch`` on every node with SLURM's batch variables and an ``srun`` that starts the
    node's tasks (forked from one import), as ``sbatch`` runs it on the job's first node; its store
    and control plane are a plane service on the second node, not rank 0's (the layout for
    preemptible nodes)."""
    plane = start_plane_service(cluster, cluster.nodes[-1], example.directory, PLANE_PORT, example.services)
    for node in cluster.nodes:
        layout = Layout(NODES, node.index, WORKERS, f"node[1-{NODES}]", job_name="prague-digits")
        srun_dir = example.directory / f"bin-{node.name}"
        write_srun(srun_dir, preload=True, log_dir=example.directory, timeout=JOB_TIMEOUT)
        base = node_env(node, example.directory, {"LIGHTNING_PRAGUE_CONTROL_PORT": "29611", **plane})
        env = batch_environment(base, layout, "25101", ROOT, srun_dir)
        env["ROOT_DIR"] = str(example.root_dir)
        env[SPARE_VARIABLE] = "0"  # no rank of it is lost: no warm spare's imports on the loaded cores
        example.start(cluster, node, ["bash", str(EXAMPLES / "slurm.sbatch"), *train_args(example)], env)


def start_torchrun(cluster: Cluster, example: Example) -> None:
    """``torchrun.sh`` on every node, the rendezvous at node1."""
    for node in cluster.nodes:
        env = node_env(node, example.directory)
        env.update(
            MASTER_ADDR="node1", MASTER_PORT="29400", NNODES=str(NODES), NPROC_PER_NODE=str(example.world // NODES),
            JOB_ID="example-torchrun", ROOT_DIR=str(example.root_dir), LIGHTNING_PRAGUE_CONTROL_PORT="29621",
        )  # fmt: skip
        example.start(cluster, node, ["bash", str(EXAMPLES / "torchrun.sh"), *train_args(example)], env)


def manifest_job(plane: bool = False) -> dict:
    """The Job of ``kubernetes.yaml``; `plane`: with ``LIGHTNING_PRAGUE_PLANE`` uncommented, as
    ``plane.yaml`` tells its users to."""
    text = (EXAMPLES / "kubernetes.yaml").read_text()
    if plane:
        commented = "# - name: LIGHTNING_PRAGUE_PLANE"
        assert text.count(commented) == 1, "kubernetes.yaml no longer holds LIGHTNING_PRAGUE_PLANE, commented out"
        start = text.index(commented)
        end = text.index("\n", text.index("#   value:", start))
        snippet = text[start:end].replace("# - name:", "- name:", 1).replace("#   value:", "  value:", 1)
        text = text[:start] + snippet + text[end:]
    documents = list(yaml.safe_load_all(text))
    return next(d for d in documents if d["kind"] == "Job")


def start_manifest_plane(cluster: Cluster, example: Example) -> None:
    """``plane.yaml``'s Deployment on the second node: its container's command and its environment (the
    Job's Secret), the name it advertises this cluster's (the Service's there), logging in the
    example's folder."""
    documents = list(yaml.safe_load_all((EXAMPLES / "plane.yaml").read_text()))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    node = cluster.nodes[-1]
    command = list(container["command"])
    assert command[:2] == ["lightning-prague", "plane"] and "--advertise" in command, command
    command[command.index("--advertise") + 1] = node.name
    assert command[command.index("--port") + 1] == str(MANIFEST_PLANE_PORT), command
    argv = [sys.executable, "-m", "lightning_prague.cli", *command[1:], "--log-dir", str(example.directory / "plane")]
    env = node_env(node, example.directory, pod_environment(container, 0, {}))
    with open(example.directory / f"plane-{node.name}.log", "w") as log:
        example.services.append(cluster.run(node, argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))


#: the Job's uid, as Kubernetes labels each of its pods (the same for every pod of one Job)
JOB_UID = "3f1c7a52-0d4e-4e8a-9b61-5c2f0e7d9a10"


def pod_environment(container: dict, index: int, cluster_values: dict[str, str]) -> dict[str, str]:
    """A pod's variables from its container's ``env``: literal values, the completion index and the
    Job's uid where a variable takes them from the pod's annotation and label (as Kubernetes fills
    them in), and ``cluster_values`` where this cluster's differ from the manifest's (host names,
    sizes, interfaces, paths)."""
    from_pod = {
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index),
        "metadata.labels['batch.kubernetes.io/controller-uid']": JOB_UID,
    }
    env: dict[str, str] = {}
    for variable in container["env"]:
        if "value" in variable:
            env[variable["name"]] = str(variable["value"])
        elif "secretKeyRef" in variable["valueFrom"]:  # the Secret made per job, as `kubectl create secret` would
            reference = variable["valueFrom"]["secretKeyRef"]
            assert (reference["name"], reference["key"]) == ("prague-digits-secret", "secret"), reference
            env[variable["name"]] = JOB_SECRET
        else:
            field_path = variable["valueFrom"]["fieldRef"]["fieldPath"]
            assert field_path in from_pod, field_path
            env[variable["name"]] = from_pod[field_path]
    unknown = set(cluster_values) - set(env)
    assert not unknown, f"the manifest sets none of {unknown}"
    return {**env, **cluster_values}


def start_kubernetes(cluster: Cluster, example: Example) -> None:
    """``plane.yaml``'s plane service on the second node (`start_manifest_plane`), then one pod per node
    (`start_pod`), each with ``LIGHTNING_PRAGUE_PLANE``: pod 0 is then like any other, and is lost."""
    start_manifest_plane(cluster, example)
    for index in range(len(cluster.nodes)):
        start_pod(cluster, example, index)


#: a replacement pod's process whose image is warm (torch and Lightning imported): it waits for a
#: file (`argv[1]`), then runs the container's `python` command line (`argv[2:]`) in itself. What a pod
#: takes to be scheduled and to start its interpreter is not what the test is about; its rejoin is
GATED_POD = """
import pathlib, runpy, sys, time
import lightning.pytorch, torch, lightning_prague
gate = pathlib.Path(sys.argv[1])
while not gate.exists():
    time.sleep(0.05)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def start_pod(cluster: Cluster, example: Example, index: int, name: str = "", gate: Path | None = None) -> None:
    """Pod `index` on node `index + 1`: its container's command, in the working directory the image
    has the repository in, with the manifest's environment (a replacement pod: the same, nothing kept;
    with `gate`, its process starts warm and runs the container's command line once `gate` exists)."""
    job = manifest_job(plane=True)
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = [*container["command"], *container["args"]]
    node = cluster.nodes[index]
    cluster_values = {
        "WORLD_SIZE": str(example.world), "MASTER_ADDR": "node1", "MASTER_PORT": "29410",
        "LIGHTNING_PRAGUE_CONTROL_PORT": "29631", "NCCL_SOCKET_IFNAME": node.ifname,
        "GLOO_SOCKET_IFNAME": node.ifname, "ROOT_DIR": str(example.root_dir),
        "TRAIN_ARGS": " ".join(train_args(example)),
        "LIGHTNING_PRAGUE_PLANE": f"{cluster.nodes[-1].name}:{MANIFEST_PLANE_PORT}",
    }  # fmt: skip
    env = node_env(node, example.directory)
    env.update(pod_environment(container, index, cluster_values))
    env[SPARE_VARIABLE] = "0"  # a lost pod takes its keeper and spare along: a replacement pod starts afresh
    if gate is not None:  # the container's own command line, its `python` started warm behind the gate
        (line,) = container["args"]
        assert line.strip().startswith("exec python "), line
        command = [*container["command"], line.replace("exec python ", 'exec python -c "$GATED_POD" "$POD_GATE" ', 1)]
        env.update(GATED_POD=GATED_POD, POD_GATE=str(gate))
    example.start(cluster, node, command, env, name)


#: the gate of the Kubernetes example's replacement pod (`GATED_POD`), in the example's folder
REPLACEMENT_GATE = "replacement.gate"


def lose_a_rank(examples: dict[str, Example], deadline: float) -> None:
    """Once each of `LOST_RANK`'s first epoch is over (its first checkpoint): torchrun's rank 0
    training process is killed (SIGKILL) once its keeper's warm spare is warm (it starts 5 s after the
    keeper, and its CPU time then stands still: `IdleProcesses`), and its keeper starts it again;
    Kubernetes' pod 0 is lost (its processes SIGKILLed) and the replacement pod with the same index
    starts (`REPLACEMENT_GATE`)."""
    waiting = list(LOST_RANK)
    warm = IdleProcesses()
    while waiting and time.monotonic() < deadline:
        for launcher in list(waiting):
            example = examples[launcher]
            if not any((example.root_dir / "checkpoints").glob("epoch=*.ckpt")):
                continue
            if launcher == "torchrun":
                rank = LOST_RANK[launcher]
                kept = keeper_children({"TORCHELASTIC_RUN_ID=example-torchrun", f"RANK={rank}"})
                if "training" not in kept or "spare" not in kept or not warm.settled(kept["spare"]):
                    continue
                os.kill(kept["training"], signal.SIGKILL)
                example.lost = f"killed rank {rank}'s training process (pid {kept['training']})"
            else:
                os.killpg(example.procs[LOST_RANK[launcher]].pid, signal.SIGKILL)
                (example.directory / REPLACEMENT_GATE).touch()
                example.lost = f"pod {LOST_RANK[launcher]} lost; a replacement pod started"
            waiting.remove(launcher)
        time.sleep(0.1)
    for launcher in waiting:
        examples[launcher].lost = "no rank of it was lost in time (its first epoch or its keeper's spare)"


#: what train.py prints at the end of each rank's fit: rank, epoch, parameters, restart, batches trained
FINISHED = re.compile(
    r"train\.py: rank (\d+) finished the fit at epoch (\d+), step \d+, .*parameters (\w+); "
    r"this process \(restart (\d+)\) trained (\d+) batches"
)


# -- the demo's srun-style jobs


@dataclass
class Job:
    """One strategy's demo job on one launch path: where it writes, and its processes once started."""

    path: str
    strategy: str
    directory: Path
    job_id: str = ""  # srun-style: SLURM_JOB_ID (its tasks log to the launchers' directory, the parent)
    procs: list[subprocess.Popen] = field(default_factory=list)
    #: processes that serve the job until it ends (a plane service), stopped then
    services: list[subprocess.Popen] = field(default_factory=list)
    codes: list[int | None] = field(default_factory=list)
    rejoin: bool = False  # the job a rank rejoins and two new workers join (`REJOIN`)
    replicas: bool = False  # in replica groups of a node (`REPLICAS`)

    @property
    def out(self) -> Path:
        return self.directory / "result.json"

    def results(self) -> dict[int, dict]:
        """Each rank's result: the leader's ``result.json`` and the others' ``result.rankN.json``."""
        files = [self.out, *sorted(self.directory.glob("result.rank*.json"))]
        found = [json.loads(path.read_text()) for path in files if path.exists()]
        return {result["rank"]: result for result in found}

    def log_paths(self) -> list[Path]:
        """The job's logs: its processes' and its supervisor's (in ``TMPDIR``, named by ``MASTER_PORT``)."""
        if self.path == "torchrun":
            return sorted(self.directory.glob("*.log")) + sorted(self.directory.rglob("lightning_prague-supervisor-*"))
        launchers = self.directory.parent
        port = 15000 + int(self.job_id[-4:])  # Lightning's MASTER_PORT under SLURM
        return [
            *sorted(launchers.glob("srun-*.log")),
            *sorted(launchers.glob(f"job{self.job_id}.rank*.log")),
            *sorted(launchers.rglob(f"lightning_prague-supervisor-{port}*")),
        ]

    def logs(self, chars: int = 2500) -> str:
        """The end of every log of the job, for a failure's message."""
        return tail(self.log_paths(), chars)


def start_demo_torchrun(cluster: Cluster, job: Job, port: int) -> None:
    """One torchrun agent per node, rendezvous at node1 (c10d); each agent starts 2 workers."""
    for node in cluster.nodes:
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(WORKERS),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node1:{port}", "--rdzv-id", f"{job.strategy}-{port}",
            "-m", "lightning_prague.demo.run", *demo_args(job.strategy, job.out, replicas=job.replicas),
        ]  # fmt: skip
        with open(job.directory / f"torchrun-{node.name}.log", "w") as log:  # the process keeps its own copy
            job.procs.append(
                cluster.run(node, argv, node_env(node, job.directory), stdout=log, stderr=subprocess.STDOUT)
            )


def start_srun(
    cluster: Cluster, jobs: list[Job], directory: Path, gate: Path, secret: dict[str, str]
) -> list[subprocess.Popen]:
    """One srun-style launcher per node for all ``jobs`` (job ids 25001, ...): each forks its node's
    ranks of every job from one import of Lightning; the partitioned job's once ``gate`` exists.
    ``secret``: the variable of the secret every job's ranks share (the partitioned job's plane's)."""
    for i, job in enumerate(jobs):
        job.job_id = str(25001 + i)
    steps = []
    for job in jobs:
        partitioned = job.strategy == PARTITIONED and not job.rejoin
        step = {"job_id": job.job_id, "argv": demo_args(job.strategy, job.out, partitioned, job.rejoin)}
        steps.append({**step, "gate": str(gate)} if partitioned else step)
    (directory / "steps.json").write_text(json.dumps(steps))
    procs = []
    for node in cluster.nodes:
        argv = [
            sys.executable, "-m", "lightning_prague.tools.cluster.srun", "--nnodes", str(NODES),
            "--node-id", str(node.index),
            "--ntasks-per-node", str(WORKERS), "--nodelist", f"node[1-{NODES}]", "--master-addr", "node1",
            "--preload", "--steps", str(directory / "steps.json"), "--log-dir", str(directory),
            "--timeout", str(2 * JOB_TIMEOUT), "-m", "lightning_prague.demo.run",
        ]  # fmt: skip
        with open(directory / f"srun-{node.name}.log", "w") as log:
            procs.append(
                cluster.run(
                    node, argv, node_env(node, directory, secret), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
                )
            )
    return procs


#: what Lightning prints in each rank's set-up under SLURM: the rank is about to train
READY = "SLURM auto-requeueing"


def cut_node1(cluster: Cluster, job: Job, procs: list[subprocess.Popen], deadline: float) -> None:
    """Once every rank of the partitioned ``job`` has set up: node1's link down for `CUT_SECONDS` (the
    node of its rank 0; its plane service runs on node2)."""
    logs = [job.directory.parent / f"job{job.job_id}.rank{rank}.log" for rank in range(NODES * WORKERS)]
    while not all(log.exists() and READY in log.read_text(errors="replace") for log in logs):
        if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs):
            return  # the jobs' own checks report what went wrong
        time.sleep(0.2)
    time.sleep(1.0)
    cluster.cut("node1")
    try:
        time.sleep(CUT_SECONDS)
    finally:
        cluster.heal("node1")


#: a process that imports the demo, waits for a file, then runs the demo (`sys.argv[2:]`): a new
#: process that starts when the fault strikes, without the imports' seconds on the path to its fit
GATED_DEMO = """
import pathlib, runpy, sys, time
import lightning_prague.demo.run
gate = pathlib.Path(sys.argv[1])
while not gate.exists():
    time.sleep(0.05)
sys.argv = ["lightning_prague.demo.run", *sys.argv[2:]]
sys.modules.pop("lightning_prague.demo.run")  # its dependencies stay imported; runpy warns of a module run twice
runpy.run_module("lightning_prague.demo.run", run_name="__main__", alter_sys=True)
"""


def rejoin_and_grow(cluster: Cluster, job: Job, secret: dict[str, str]) -> None:
    """Processes that start once the rejoin job's rank 2 killed itself (`GATED_DEMO`), each as a new
    step of the job (`SLURM_STEP_ID` 1, 2, 3) with `LIGHTNING_PRAGUE_REJOIN=1`: a new one for rank 2
    on node2 with the variables srun gave it, and two new workers, ranks 4 and 5 (`SLURM_PROCID`; the
    job keeps its `SLURM_NTASKS`), one per node (``job.procs``)."""
    port = str(15000 + int(job.job_id[-4:]))  # Lightning's MASTER_PORT under SLURM
    starts = [(cluster.nodes[1], 1, 0), (cluster.nodes[0], 2, 0), (cluster.nodes[1], 2, 1)]  # node, node id, local id
    for step, (node, node_id, local) in enumerate(starts, start=1):
        layout = Layout(NODES, node_id, WORKERS, f"node[1-{NODES}]")
        env = task_environment(node_env(node, job.directory.parent, secret), layout, job.job_id, local, step_id=step)
        env.update(MASTER_ADDR="node1", MASTER_PORT=port)
        # every one is told: started together, they are admitted together (a process that finds the fit by
        # itself asks later, and a join request that reaches the members while the first joiners take up
        # their first groups can hold both: see the closing note of this change; the discovery across
        # steps is tested in tests/test_srun_heal.py)
        env["LIGHTNING_PRAGUE_REJOIN"] = "1"
        gate = str(job.directory / "fault.2.json")
        argv = [sys.executable, "-c", GATED_DEMO, gate, *demo_args(job.strategy, job.out, rejoin=True)]
        log_path = job.directory.parent / f"job{job.job_id}.rank{layout.rank(local)}.rejoin.log"
        with open(log_path, "w") as log:
            job.procs.append(cluster.run(node, argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))


@dataclass
class Jobs:
    """Everything the fixture ran: the examples by launcher, the demo's jobs by (path, strategy)."""

    examples: dict[str, Example]
    demo: dict[tuple[str, str], Job]


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory) -> Jobs:
    """The examples and the demo's jobs, started at once, but the partitioned job, which starts (and
    is cut) once the examples are over (the rejoin job runs on through the cut); waited for."""
    root = tmp_path_factory.mktemp("cluster")
    examples = {launcher: Example(launcher, root / "examples" / launcher) for launcher in EXAMPLE_STRATEGIES}
    examples["kubernetes"].world = NODES  # one pod per node
    examples["torchrun"].world = NODES  # one worker per node: fresh interpreters cost the most here
    for example in examples.values():
        example.directory.mkdir(parents=True)
    start_slurm(cluster, examples["slurm"])
    start_torchrun(cluster, examples["torchrun"])
    start_kubernetes(cluster, examples["kubernetes"])
    gate = examples["kubernetes"].directory / REPLACEMENT_GATE
    lost_pod = LOST_RANK["kubernetes"]  # its replacement: warm, behind its gate
    start_pod(cluster, examples["kubernetes"], lost_pod, f"{cluster.nodes[lost_pod].name}-replacement", gate)
    losing = threading.Thread(target=lose_a_rank, args=(examples, time.monotonic() + JOB_TIMEOUT))
    losing.start()
    made: dict[tuple[str, str], Job] = {}
    for path, strategies in (("torchrun", TORCHRUN), ("srun", SRUN)):
        for strategy in strategies:
            made[path, strategy] = Job(path, strategy, root / path / strategy)
            made[path, strategy].directory.mkdir(parents=True)
    for i, strategy in enumerate(TORCHRUN):
        start_demo_torchrun(cluster, made["torchrun", strategy], 29500 + i)
    replicas = made["torchrun-replicas", REPLICAS] = Job(
        "torchrun", REPLICAS, root / "torchrun-replicas", replicas=True
    )
    replicas.directory.mkdir(parents=True)
    start_demo_torchrun(cluster, replicas, 29490)
    made["srun-rejoin", REJOIN] = Job("srun", REJOIN, root / "srun" / f"{REJOIN}-rejoin", rejoin=True)
    made["srun-rejoin", REJOIN].directory.mkdir(parents=True)
    srun_jobs = [made["srun", strategy] for strategy in SRUN] + [made["srun-rejoin", REJOIN]]
    gate = root / "srun" / "partition.gate"
    (root / "srun").mkdir(exist_ok=True)
    services: list[subprocess.Popen] = []  # the partitioned job's plane service, on node2
    plane = start_plane_service(cluster, cluster.nodes[-1], root / "srun", PARTITION_PLANE_PORT, services)
    secret = {"LIGHTNING_PRAGUE_SECRET_FILE": plane["LIGHTNING_PRAGUE_SECRET_FILE"]}
    srun_procs = start_srun(cluster, srun_jobs, root / "srun", gate, secret)
    deadline = time.monotonic() + JOB_TIMEOUT
    rejoin_and_grow(cluster, made["srun-rejoin", REJOIN], secret)  # (the job's secret, as its first tasks')
    losing.join()
    for example in examples.values():
        example.codes = wait(example.procs, deadline)
        for service in example.services:
            service.terminate()
            service.wait(30)
    for strategy in TORCHRUN:
        made["torchrun", strategy].codes = wait(made["torchrun", strategy].procs, deadline)
    replicas.codes = wait(replicas.procs, deadline)
    gate.touch()  # the examples are over: the partitioned job starts, and the cut touches none of them
    deadline = time.monotonic() + JOB_TIMEOUT
    cut_node1(cluster, made["srun", PARTITIONED], srun_procs, deadline)
    made["srun-rejoin", REJOIN].codes = wait(made["srun-rejoin", REJOIN].procs, deadline)
    srun_codes = wait(srun_procs, deadline)
    for service in services:
        service.terminate()
        service.wait(30)
    for job in srun_jobs:
        if not job.rejoin:
            job.codes = srun_codes  # the launchers' worst task of all jobs; each job is judged by its results
    return Jobs(examples, made)


@pytest.mark.parametrize("launcher", list(EXAMPLE_STRATEGIES))
def test_each_example_job_script_trains_to_the_end_of_the_fit(jobs, launcher):
    """The launcher's processes exit 0; every rank prints the end of the fit at the last epoch with
    the same parameters; the root directory holds the last checkpoint, the `workers/live` metric (the
    whole world at every synchronization point) and the supervisor's log, whose path rank 0 printed."""
    example = jobs.examples[launcher]
    logs = tail(example.logs())
    # a lost pod's status is SIGKILL's (what Kubernetes records for it); its replacement's is 0
    expected = [0] * NODES
    if launcher == "kubernetes":
        expected[LOST_RANK[launcher]] = -signal.SIGKILL
        expected.append(0)
    assert example.codes == expected, f"{launcher}'s processes exited with {example.codes}\n{logs}"
    lines = FINISHED.findall(example.output())
    finished = {
        int(rank): (int(epoch), digest, int(restart), int(batches)) for rank, epoch, digest, restart, batches in lines
    }
    assert len(lines) == len(finished), f"a rank finished twice: {lines}"
    assert sorted(finished) == list(range(example.world)), f"ranks that finished: {sorted(finished)}\n{logs}"
    assert {epoch for epoch, *_ in finished.values()} == {example.epochs}, finished
    assert len({digest for _, digest, *_ in finished.values()}) == 1, f"the ranks' models differ: {finished}"
    assert (example.root_dir / "checkpoints" / "last.ckpt").is_file(), sorted(example.root_dir.rglob("*"))
    (metrics,) = example.root_dir.glob("metrics/version_*/metrics.csv")
    live = [float(row["workers/live"]) for row in csv.DictReader(metrics.open()) if row.get("workers/live")]
    if launcher in LOST_RANK:
        assert example.lost.startswith(("killed", f"pod {LOST_RANK[launcher]} lost")), example.lost
        # the rank came back and trained: its keeper's new process (torchrun), a new pod (nothing kept)
        _, _, restart, batches = finished[LOST_RANK[launcher]]
        assert restart == (1 if launcher == "torchrun" else 0) and batches > 0, (finished, example.lost, logs)
        if launcher == "kubernetes":
            rank = LOST_RANK[launcher]
            replacement = example.log(f"node{rank + 1}-replacement").read_text()  # (pod i runs on node i + 1)
            assert f"train.py: rank {rank} finished" in replacement, logs
        # the workers at each synchronization point: one fewer for a while, the whole world at the end
        assert live and min(live) >= example.world - 1 and live[-1] == example.world, live
    else:
        assert live and set(live) == {example.world}, live
    if launcher in PLANE_SERVICE:  # no rank started a supervisor: the service on the other node served the job
        assert "the supervisor (pid" not in example.output(), logs
        assert not list(example.root_dir.glob("lightning_prague_logs/supervisor-*.log")), logs
        plane_log = (example.directory / "plane" / "plane.log").read_text()
        assert "serving" in (example.directory / "plane-node2.log").read_text() and "store" in plane_log, logs
    else:
        (supervisor_log,) = (example.root_dir / "lightning_prague_logs").glob("supervisor-*.log")
        assert f"logs to {supervisor_log}" in example.output(), logs
    if launcher in SECRET_FILES:  # the script made the job's secret: one file, only its owner may read it
        (secret,) = example.root_dir.glob(".secret-*")
        assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text().strip()) >= 40
    assert "without a secret of its own" not in example.output(), logs  # (the manifest's comes from a Secret)


def test_torchrun_runs_replica_groups_of_a_node_that_end_with_one_model(jobs):
    """Issue 50's launch: a torchrun agent per node, `replica_size="node"` (each node's two ranks one
    synchronous replica, decentralized between the nodes): every rank ends the fit, a replica's ranks take
    every step together, and the replicas end with one model."""
    job = jobs.demo["torchrun-replicas", REPLICAS]
    results = job.results()
    assert job.codes == [0] * NODES, f"torchrun agents' exit codes {job.codes}\n{job.logs()}"
    assert sorted(results) == list(range(NODES * WORKERS)), f"results of ranks {sorted(results)}\n{job.logs()}"
    assert len({r["params_sha256"] for r in results.values()}) == 1, f"the ranks' models differ\n{job.logs()}"
    batches = results[0]["batches_per_worker"]
    for node in range(NODES):  # a node's ranks: one replica, every step together
        first = node * WORKERS
        assert len(set(batches[first : first + WORKERS])) == 1, batches
    assert all(r["lost_workers"] == {} and r["epochs_run"] == 1 for r in results.values()), job.logs()


def test_the_kubernetes_manifest_runs_as_many_pods_as_its_world_size():
    job = manifest_job()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    env = pod_environment(pod["containers"][0], 0, {})
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["WORLD_SIZE"])
    # pod 0's name in the headless Service: <job>-0.<subdomain>
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{pod['subdomain']}", env["MASTER_ADDR"]


CASES = [("torchrun", s) for s in TORCHRUN] + [("srun", s) for s in SRUN if s != PARTITIONED]


if CASES:  # LPC_CLUSTER_ALL=1: every strategy's demo through torchrun and srun-style, one fit each

    @pytest.mark.parametrize("path,strategy", CASES, ids=[f"{path}-{strategy}" for path, strategy in CASES])
    def test_every_rank_ends_the_fit_with_one_model(jobs, path, strategy):
        job = jobs.demo[path, strategy]
        results = job.results()
        if path == "torchrun":
            assert job.codes == [0] * NODES, f"torchrun agents' exit codes {job.codes}\n{job.logs()}"
        assert sorted(results) == list(range(NODES * WORKERS)), f"results of ranks {sorted(results)}\n{job.logs()}"
        digests = {rank: r["params_sha256"] for rank, r in results.items()}
        assert len(set(digests.values())) == 1, f"the ranks' models differ: {digests}\n{job.logs()}"
        for rank, result in results.items():
            assert result["epochs_run"] == 1 and result["global_step"] > 0, (rank, result["epochs_run"], job.logs())
            assert result["lost_workers"] == {}, (rank, result["lost_workers"], job.logs())
        assert sum(results[0]["batches_per_worker"]) > 0


def test_rank_0s_node_cut_off_beyond_the_bound_fences_itself_and_the_other_finishes_on_a_plane_service(jobs):
    """The partitioned job's store and control plane are a plane service on node2, and node1, where its
    rank 0 runs, is cut off: node1's ranks are silent beyond their bound, the control plane counts
    them lost, node2's ranks finish with one model (rank 2 leads now), and node1's end themselves
    with exit status 75, or fail their fit with `ControlPlaneLost`, with a message that says why (they
    never finish a fit of their own). Rank 0's node was lost like any other."""
    job = jobs.demo["srun", PARTITIONED]
    results = job.results()
    cut, survivors = list(range(WORKERS)), list(range(WORKERS, NODES * WORKERS))
    assert sorted(results) == survivors, f"results of ranks {sorted(results)}\n{job.logs()}"
    assert len({results[r]["params_sha256"] for r in survivors}) == 1, job.logs()
    for rank in survivors:
        assert sorted(map(int, results[rank]["lost_workers"])) == cut, (rank, results[rank]["lost_workers"])
        assert results[rank]["epochs_run"] == 6, (rank, results[rank]["epochs_run"], job.logs())
    launcher = (job.directory.parent / "srun-node1.log").read_text()
    for rank in cut:
        log = (job.directory.parent / f"job{job.job_id}.rank{rank}.log").read_text()
        assert "cut off from the control plane" in log or "the control plane fenced this rank" in log, log[-3000:]
        # it ended itself (stuck in an exchange with a peer across the cut), or its training thread
        # learnt of the cut at its next contact with the control plane and its fit failed with
        # ControlPlaneLost (docs/fault_tolerance.md, Partitions)
        ended = f"(job {job.job_id} rank {rank}) exited with 75" in launcher
        failed = f"(job {job.job_id} rank {rank}) exited with 1" in launcher and "ControlPlaneLost" in log
        assert ended or failed, f"{launcher}\n{job.logs()}"


def test_a_rank_started_again_rejoins_and_two_new_workers_join_on_the_cluster(jobs):
    """SLURM-style: rank 2 (node2) is killed; a new step of the job starts it again with its old
    variables and nothing added, and it rejoins; ranks 4 and 5 join the 4-worker job; every fit
    returns, with one model, and each of the three trained after it joined."""
    job = jobs.demo["srun-rejoin", REJOIN]
    results = job.results()
    assert job.codes == [0, 0, 0], f"the three new processes' exit codes {job.codes}\n{job.logs()}"
    assert sorted(results) == list(range(6)), f"results of ranks {sorted(results)}\n{job.logs()}"
    assert len({r["params_sha256"] for r in results.values()}) == 1, job.logs()
    struck = json.loads((job.directory / "fault.2.json").read_text())["time"]
    for rank in (2, 4, 5):
        assert results[rank]["batches_this_process"] > 0 and results[rank]["first_batch_time"] > struck, rank
    for rank, result in results.items():
        assert result["epochs_run"] == REJOIN_EPOCHS, (rank, result["epochs_run"], job.logs())
    # what the srun-style launchers saw of the job's own tasks: the killed one, and the others' 0
    launchers = "\n".join(p.read_text() for p in sorted(job.directory.parent.glob("srun-*.log")))
    assert f"(job {job.job_id} rank 2) exited with -9" in launchers, launchers[-3000:]  # it prints only failures
    for rank in (0, 1, 3):
        assert f"(job {job.job_id} rank {rank}) exited with" not in launchers, launchers[-3000:]


# -- the tool itself


def in_node(cluster: Cluster, node: str, code: str) -> str:
    """Run a line of Python inside ``node``; its output."""
    return cluster.check_output(node, [sys.executable, "-c", code]).strip()


def test_nodes_resolve_names_as_debian_does(cluster):
    # each node: its own name on 127.0.1.1, the other at its bridge address
    code = "import socket as s; n = s.gethostname(); print(n, s.gethostbyname(n), s.gethostbyname('{}'))"
    assert in_node(cluster, "node1", code.format("node2")) == "node1 127.0.1.1 10.77.0.2"
    assert in_node(cluster, "node2", code.format("node1")) == "node2 127.0.1.1 10.77.0.1"
    routes = cluster.check_output("node1", ["ip", "route"])
    assert "default" not in routes and routes.count("\n") == 1, routes  # the subnet only: nowhere else


def test_a_server_on_the_own_names_address_is_unreachable_from_other_nodes(cluster):
    # what made a control plane bound to the address of node1's name (127.0.1.1) fail on a real
    # cluster: the emulation reproduces it, so the training jobs above would catch it
    bind_own_name = (
        "import socket as s, time; x = s.create_server((s.gethostbyname(s.gethostname()), 7071)); time.sleep(30)"
    )
    server = cluster.run("node1", [sys.executable, "-c", bind_own_name])
    try:
        connect = "import socket, time; time.sleep(0.3); socket.create_connection(('{}', 7071), timeout=2); print('ok')"
        assert in_node(cluster, "node1", connect.format("node1")) == "ok"
        with pytest.raises(Exception, match="ConnectionRefusedError"):
            in_node(cluster, "node2", connect.format("node1"))
    finally:
        server.kill()
        server.wait()


LISTEN = """
import socket, sys
server = socket.create_server(("0.0.0.0", 7070))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    while conn.recv(1 << 16):
        pass
    conn.sendall(b"ok")
    conn.close()
"""

SEND = """
import socket, time
start = time.monotonic()
with socket.create_connection(("{host}", 7070), timeout={timeout}) as conn:
    conn.sendall(b"x" * {size})
    conn.shutdown(socket.SHUT_WR)
    assert conn.recv(2) == b"ok"
print(time.monotonic() - start)
"""


def send_seconds(cluster: Cluster, source: str, target: str, size: int, timeout: float = 10) -> float:
    """Seconds to send ``size`` bytes from node ``source`` to the listener on node ``target``."""
    return float(in_node(cluster, source, SEND.format(host=target, size=size, timeout=timeout)))


@pytest.fixture(scope="module")
def listeners(cluster):
    """A TCP sink on port 7070 of every node, once each listens (a loaded machine may take seconds to
    start an interpreter: a fixed pause was too short in CI)."""
    procs = [cluster.run(node, [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE) for node in cluster.nodes]
    for node, proc in zip(cluster.nodes, procs):
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"listening\n", f"the listener on {node.name} did not start"
    yield
    for proc in procs:
        proc.kill()
        proc.wait()


def test_links_are_shaped_both_ways(cluster, listeners):
    size = 2_000_000  # bytes: 16 Mbit, well above the token bucket's burst (256 KiB)
    sent = cluster.sent_bytes("node1")
    fast = send_seconds(cluster, "node1", "node2", size)
    assert size <= cluster.sent_bytes("node1") - sent < 1.2 * size, "what node1 sent out of its link, headers too"
    cluster.shape("node2", "32mbit")  # 0.5 s each way, less the burst
    try:
        to_node2 = send_seconds(cluster, "node1", "node2", size)
        from_node2 = send_seconds(cluster, "node2", "node1", size)
    finally:
        cluster.shape("node2", "1gbit")
    assert 0.35 < to_node2 < 2 and 0.35 < from_node2 < 2, (to_node2, from_node2)
    assert fast < 0.2, fast


def test_cut_partitions_a_node_and_heal_rejoins_it(cluster, listeners):
    assert send_seconds(cluster, "node1", "node2", 1000) < 1
    cluster.cut("node2")
    try:
        with pytest.raises(Exception, match="timed out|No route|unreachable"):
            cluster.check_output("node1", [sys.executable, "-c", SEND.format(host="node2", size=1000, timeout=1)])
    finally:
        cluster.heal("node2")
    assert send_seconds(cluster, "node1", "node2", 1000) < 5


def test_teardown_removes_everything_and_is_idempotent(cluster):
    small = Cluster(1, prefix=PREFIX, subnet="10.77.1").start()
    small.run("node1", ["sleep", "600"])
    assert any(ns.startswith(small.id) for ns in namespaces())
    small.teardown()
    small.teardown()
    assert small.id not in cluster_ids(PREFIX)
    assert not Path(f"/etc/netns/{small.id}-node1").exists()
    assert small.processes[0].poll() is not None


def test_sigterm_tears_down_and_cleanup_removes_leftovers(cluster, tmp_path):
    cli = [sys.executable, "-m", "lightning_prague.tools.cluster"]
    up = subprocess.Popen(
        [*cli, "up", "--nodes", "1", "--prefix", PREFIX, "--subnet", "10.77.2"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    first = up.stdout.readline()  # "cluster ID (switch namespace ...)" once it is built
    assert first.startswith("cluster "), first
    built = first.split()[1]
    assert built in cluster_ids(PREFIX)
    up.send_signal(signal.SIGTERM)
    assert up.wait(20) == -signal.SIGTERM
    assert built not in cluster_ids(PREFIX)
    # a leftover of a process long gone (pid above any pid_max), then the cleanup command
    leftover = f"{PREFIX}4999999-1"
    subprocess.run(["ip", "netns", "add", f"{leftover}-node1"], check=True)
    # the cleanup command, forked from this process (as `python -m lightning_prague.tools.cluster cleanup ...`)
    done = run_forked("lightning_prague.tools.cluster", ["cleanup", "--prefix", PREFIX], dict(os.environ), ROOT, 120)
    assert done.returncode == 0 and leftover in done.stdout, done
    assert leftover not in cluster_ids(PREFIX)
    assert cluster.id in cluster_ids(PREFIX), "a live cluster is left alone"
