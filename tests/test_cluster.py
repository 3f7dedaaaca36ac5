"""Several nodes for real: the strategies on an emulated cluster of 2 nodes x 2 workers.

The cluster (`lightning_prague.tools.cluster`) makes each node a network namespace with its own host name and a
Debian-style ``/etc/hosts`` (the node's own name on 127.0.1.1, the other node at its bridge
address), joined by 1 Gbit/s links shaped with ``tc``; gloo is told each node's interface
(``GLOO_SOCKET_IFNAME``), as on any machine with more than one. Each node's processes are started
inside it and both nodes' at the same time; every rank of a job must end its fit with the same
model (one ``params_sha256``).

What runs (about 45 s on two cores; each job's ranks start and train concurrently with the others):

- **torchrun** (``--rdzv-backend c10d --rdzv-endpoint node1:PORT``, one agent per node, fresh
  interpreters: 6 imports of Lightning per job, the costliest launch here): ``prague``.
- **srun-style** (``lightning_prague.tools.cluster.srun``: per rank the variables ``srun`` sets, ``MASTER_ADDR``
  node1, ``MASTER_PORT`` from the job id as Lightning's ``SLURMEnvironment`` derives it):
  ``partial_reduce``, ``adpsgd`` and ``decent_adam``, so that every strategy runs once on several
  nodes within the suite's time. The ranks are forked from one process per node that imported
  Lightning once (``--preload``): fresh interpreters would cost 4 x 7 s of imports per job here.

**A partition** shares those jobs: once every srun-style rank has set up, node2's link is cut for
``CUT_SECONDS`` (10 s). ``decent_adam``'s job has a 3 s detection bound: node2's ranks are counted
lost, node1's finish with one model, and node2's fence themselves (exit status 75, a message that
says they were cut off). The other jobs have a 30 s bound: the cut is short for them, and every rank
finishes as without it. (The torchrun job may be cut too, in its set-up or its training: a short cut.)

``LPC_CLUSTER_ALL=1`` runs every strategy both ways (about twice as long).

Plus checks of the tool itself: hosts and host names, shaping, cut and heal, the tear-down.
Skipped with the reason when this machine cannot create network namespaces (not root, no ``ip``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lightning_prague.tools.cluster import Cluster, ClusterUnavailable, clean_environment
from lightning_prague.tools.cluster.emulate import cluster_ids, namespaces
from lightning_prague.tools.cluster.srun import Layout, task_environment

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(240)

STRATEGIES = ("prague", "partial_reduce", "adpsgd", "decent_adam")
EVERY_WAY = bool(os.environ.get("LPC_CLUSTER_ALL"))  # every strategy on both launch paths (about twice as long)
TORCHRUN = STRATEGIES if EVERY_WAY else ("prague",)
#: the srun-style job whose ranks on node2 are cut off for longer than its detection bound
PARTITIONED = "decent_adam"
SRUN = STRATEGIES if EVERY_WAY else ("partial_reduce", "adpsgd", PARTITIONED)
#: node2's link is down this long once every srun-style rank has set up: longer than the partitioned
#: job's detection bound (`PARTITION_HANG` s, or 5 times its longest recent step if longer, as a loaded
#: machine may stretch them), well under every other job's (`HANG` s), whose cut is short
CUT_SECONDS = 10.0
PARTITION_HANG, HANG = 3.0, 30.0
NODES, WORKERS = 2, 2
#: a test prefix of our own, so that a left-over check never mistakes another user's cluster for ours
PREFIX = "lpcltest-"
#: the most seconds one job may take before its processes are killed and it fails
JOB_TIMEOUT = 150
#: the srun-style job whose rank 2 is killed (SIGKILL at its 20th batch) and started again with its
#: old environment, and which two more workers join as ranks 4 and 5 (`max_workers=6`)
REJOIN, REJOIN_EPOCHS = "prague", 25


@pytest.fixture(scope="module")
def cluster():
    """2 nodes on 1 Gbit/s links; skips when namespaces cannot be created here."""
    try:
        built = Cluster(NODES, rate="1gbit", prefix=PREFIX).start()
    except ClusterUnavailable as why:
        pytest.skip(f"no emulated cluster on this machine: {why}")
    with built:
        yield built


def demo_args(strategy: str, out: Path, partitioned: bool = False, rejoin: bool = False) -> list[str]:
    """The demo's options for one short job of ``strategy`` on the cluster; the srun-style jobs train
    through node2's cut (`CUT_SECONDS`), the partitioned one with a detection bound under it; the
    rejoin job long enough for a killed rank and two new workers to join it (`REJOIN_EPOCHS`)."""
    timing = ["--epochs", "1", "--step-time", "0.02", "--hang-timeout", str(HANG)]
    if rejoin:  # silent bound max(10 s, 150 x 0.1 s): above the cut
        timing = ["--epochs", str(REJOIN_EPOCHS), "--step-time", "0.1", "--hang-timeout", str(HANG)]
        timing += ["--hang-factor", "150", "--profile", "homogeneous", "--fault", "2:20:kill", "--max-workers", "6"]
    elif partitioned:
        timing = ["--epochs", "6", "--step-time", "0.05", "--hang-timeout", str(PARTITION_HANG), "--hang-factor", "5"]
        timing += ["--profile", "homogeneous"]
    elif out.parent.parent.name == "srun":
        # the silent bound (a cut link) is max(min(10 s, HANG), hang_factor x step): 15 s, above the cut
        timing = ["--epochs", "1", "--step-time", "0.3", "--hang-timeout", str(HANG), "--hang-factor", "50"]
        timing += ["--profile", "homogeneous"]
    return [
        "--strategy", strategy, "--devices", str(WORKERS), "--num-nodes", str(NODES), *timing,
        "--grouping-timeout", "60", "--json", str(out),
    ]  # fmt: skip


def node_env(node, directory: Path) -> dict[str, str]:
    """A node's environment: its interface for gloo, one thread, and ``TMPDIR`` in the job's directory
    (where the supervisor writes its log)."""
    return clean_environment({"GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1", "TMPDIR": str(directory)})


@dataclass
class Job:
    """One strategy's job on one launch path: where it writes, and its processes once started."""

    path: str
    strategy: str
    directory: Path
    job_id: str = ""  # srun-style: SLURM_JOB_ID (its tasks log to the launchers' directory, the parent)
    procs: list[subprocess.Popen] = field(default_factory=list)
    codes: list[int | None] = field(default_factory=list)
    rejoin: bool = False  # the job a rank rejoins and two new workers join (`REJOIN`)

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
        paths = [path for path in self.log_paths() if path.is_file()]
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in paths)


def start_torchrun(cluster: Cluster, job: Job, port: int) -> None:
    """One torchrun agent per node, rendezvous at node1 (c10d); each agent starts 2 workers."""
    for node in cluster.nodes:
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(WORKERS),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node1:{port}", "--rdzv-id", f"{job.strategy}-{port}",
            "-m", "lightning_prague.demo.run", *demo_args(job.strategy, job.out),
        ]  # fmt: skip
        with open(job.directory / f"torchrun-{node.name}.log", "w") as log:  # the process keeps its own copy
            job.procs.append(
                cluster.run(node, argv, node_env(node, job.directory), stdout=log, stderr=subprocess.STDOUT)
            )


def start_srun(cluster: Cluster, jobs: list[Job], directory: Path) -> list[subprocess.Popen]:
    """One srun-style launcher per node for all ``jobs`` (job ids 25001, ...): each forks its node's
    ranks of every job from one import of Lightning."""
    for i, job in enumerate(jobs):
        job.job_id = str(25001 + i)
    steps = [
        {
            "job_id": job.job_id,
            "argv": demo_args(job.strategy, job.out, job.strategy == PARTITIONED and not job.rejoin, job.rejoin),
        }
        for job in jobs
    ]
    (directory / "steps.json").write_text(json.dumps(steps))
    procs = []
    for node in cluster.nodes:
        argv = [
            sys.executable, "-m", "lightning_prague.tools.cluster.srun", "--nnodes", str(NODES),
            "--node-id", str(node.index),
            "--ntasks-per-node", str(WORKERS), "--nodelist", f"node[1-{NODES}]", "--master-addr", "node1",
            "--preload", "--steps", str(directory / "steps.json"), "--log-dir", str(directory),
            "--timeout", str(JOB_TIMEOUT), "-m", "lightning_prague.demo.run",
        ]  # fmt: skip
        with open(directory / f"srun-{node.name}.log", "w") as log:
            procs.append(
                cluster.run(node, argv, node_env(node, directory), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            )
    return procs


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


#: what Lightning prints in each rank's set-up under SLURM: the rank is about to train
READY = "SLURM auto-requeueing"


def cut_node2(cluster: Cluster, jobs: list[Job], procs: list[subprocess.Popen], deadline: float) -> None:
    """Once every rank of the srun-style ``jobs`` has set up: node2's link down for `CUT_SECONDS`."""
    logs = [job.directory.parent / f"job{job.job_id}.rank{rank}.log" for job in jobs for rank in range(NODES * WORKERS)]
    while not all(log.exists() and READY in log.read_text(errors="replace") for log in logs):
        if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs):
            return  # the jobs' own checks report what went wrong
        time.sleep(0.2)
    time.sleep(1.0)
    cluster.cut("node2")
    try:
        time.sleep(CUT_SECONDS)
    finally:
        cluster.heal("node2")


def rejoin_and_grow(cluster: Cluster, job: Job, deadline: float) -> None:
    """Once the rejoin job's rank 2 killed itself: a new process for it on node2 with the variables
    srun gave it and `LIGHTNING_PRAGUE_REJOIN=1` (a requeued task), and two new workers, ranks 4 and 5
    (`SLURM_PROCID`; the job keeps its `SLURM_NTASKS`), one per node; waits for the three."""
    while not (job.directory / "fault.2.json").exists():
        if time.monotonic() > deadline:
            return  # the test reports the missing ranks
        time.sleep(0.2)
    port = str(15000 + int(job.job_id[-4:]))  # Lightning's MASTER_PORT under SLURM
    starts = [(cluster.nodes[1], 1, 0), (cluster.nodes[0], 2, 0), (cluster.nodes[1], 2, 1)]  # node, node id, local id
    for node, node_id, local in starts:
        layout = Layout(NODES, node_id, WORKERS, f"node[1-{NODES}]")
        env = task_environment(node_env(node, job.directory.parent), layout, job.job_id, local)
        env.update(MASTER_ADDR="node1", MASTER_PORT=port, LIGHTNING_PRAGUE_REJOIN="1")
        argv = [sys.executable, "-m", "lightning_prague.demo.run", *demo_args(job.strategy, job.out, rejoin=True)]
        log_path = job.directory.parent / f"job{job.job_id}.rank{layout.rank(local)}.rejoin.log"
        with open(log_path, "w") as log:
            job.procs.append(cluster.run(node, argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    job.codes = wait(job.procs, deadline)


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory) -> dict[tuple[str, str], Job]:
    """Every job of both launch paths, all started at once, waited for."""
    root = tmp_path_factory.mktemp("cluster")
    made: dict[tuple[str, str], Job] = {}
    for path, strategies in (("torchrun", TORCHRUN), ("srun", SRUN)):
        for strategy in strategies:
            made[path, strategy] = Job(path, strategy, root / path / strategy)
            made[path, strategy].directory.mkdir(parents=True)
    for i, strategy in enumerate(TORCHRUN):
        start_torchrun(cluster, made["torchrun", strategy], 29400 + i)
    made["srun-rejoin", REJOIN] = Job("srun", REJOIN, root / "srun" / f"{REJOIN}-rejoin", rejoin=True)
    made["srun-rejoin", REJOIN].directory.mkdir(parents=True)
    srun_jobs = [made["srun", strategy] for strategy in SRUN] + [made["srun-rejoin", REJOIN]]
    srun_procs = start_srun(cluster, srun_jobs, root / "srun")
    deadline = time.monotonic() + JOB_TIMEOUT + 10
    cut_node2(cluster, srun_jobs, srun_procs, deadline)
    rejoin_and_grow(cluster, made["srun-rejoin", REJOIN], deadline)
    for strategy in TORCHRUN:
        job = made["torchrun", strategy]
        job.codes = wait(job.procs, deadline)
    srun_codes = wait(srun_procs, deadline)
    for job in srun_jobs:
        if not job.rejoin:
            job.codes = srun_codes  # the launchers' worst task of all jobs; each job is judged by its results
    return made


CASES = [("torchrun", s) for s in TORCHRUN] + [("srun", s) for s in SRUN if s != PARTITIONED]


@pytest.mark.parametrize("path,strategy", CASES, ids=[f"{path}-{strategy}" for path, strategy in CASES])
def test_every_rank_ends_the_fit_with_one_model(jobs, path, strategy):
    job = jobs[path, strategy]
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


def test_a_node_cut_off_beyond_the_bound_fences_itself_and_the_other_finishes(jobs):
    """Node2's ranks of the partitioned job are silent beyond its bound: the control plane counts them
    lost, node1's ranks finish with one model, and node2's end themselves with exit status 75, or fail
    their fit with `ControlPlaneLost`, with a message that says why (they never finish a fit of their own)."""
    job = jobs["srun", PARTITIONED]
    results = job.results()
    survivors, cut = list(range(WORKERS)), list(range(WORKERS, NODES * WORKERS))
    assert sorted(results) == survivors, f"results of ranks {sorted(results)}\n{job.logs()}"
    assert len({results[r]["params_sha256"] for r in survivors}) == 1, job.logs()
    for rank in survivors:
        assert sorted(map(int, results[rank]["lost_workers"])) == cut, (rank, results[rank]["lost_workers"])
        assert results[rank]["epochs_run"] == 6, (rank, results[rank]["epochs_run"], job.logs())
    launcher = (job.directory.parent / "srun-node2.log").read_text()
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
    """SLURM-style: rank 2 (node2) is killed; a new process with its old variables and
    `LIGHTNING_PRAGUE_REJOIN=1` rejoins, and ranks 4 and 5 join the 4-worker job; every fit returns,
    with one model, and each of the three trained after it joined."""
    job = jobs["srun-rejoin", REJOIN]
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
    """A TCP sink on port 7070 of every node."""
    procs = [cluster.run(node, [sys.executable, "-c", LISTEN]) for node in cluster.nodes]
    time.sleep(0.5)
    yield
    for proc in procs:
        proc.kill()
        proc.wait()


def test_links_are_shaped_both_ways(cluster, listeners):
    size = 2_000_000  # bytes: 16 Mbit, well above the token bucket's burst (256 KiB)
    fast = send_seconds(cluster, "node1", "node2", size)
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
    done = subprocess.run([*cli, "cleanup", "--prefix", PREFIX], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and leftover in done.stdout, done
    assert leftover not in cluster_ids(PREFIX)
    assert cluster.id in cluster_ids(PREFIX), "a live cluster is left alone"
