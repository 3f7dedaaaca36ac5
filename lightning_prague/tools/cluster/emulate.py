"""An emulated cluster on one machine: K nodes (network namespaces with host names) on shaped links.

Each node is a network namespace with its own host name, joined to the others by a Linux bridge
over links shaped with tc.

    python -m lightning_prague.tools.cluster run --nodes 2 --rate 1gbit -- \\
        torchrun --nnodes 2 --nproc-per-node 2 --node-rank {node_rank} \\
        --master-addr node1 --master-port 29500 -m lightning_prague.demo.run --devices 2 --num-nodes 2
    python -m lightning_prague.tools.cluster up --nodes 3 --rate 1gbit --slow-node node3 --slow-rate 100mbit
    python -m lightning_prague.tools.cluster cut lpcluster-1234-1 node2      # partition node2 from a running cluster
    python -m lightning_prague.tools.cluster cleanup                         # remove what dead clusters left behind

Why: the strategies must work across nodes whose host names resolve as on a real Debian or Ubuntu
machine (a node's own name maps to 127.0.1.1 in its ``/etc/hosts``), whose ranks meet over a
network interface that has to be named to gloo (``GLOO_SOCKET_IFNAME``), and whose links are
slower than the loopback inside a node. A namespace per node gives all three without machines:

- node ``nodeI`` (``I`` = 1..K) is the network namespace ``<cluster id>-nodeI`` with a loopback
  and one interface (``lan0`` by default) at ``<subnet>.I``; ``ip netns exec`` bind-mounts
  ``/etc/netns/<namespace>/hosts`` (written here: the node's own name on 127.0.1.1, the others at
  their addresses) over ``/etc/hosts``, and every command runs under ``unshare --uts`` with the
  node's name as its host name;
- the nodes' interfaces are veth pairs whose other ends are the ports of a bridge in a namespace of
  its own (``<cluster id>-switch``): nothing is added to the machine's own namespace, no address
  outside the cluster's subnet exists, and no namespace has a route anywhere else;
- each link is shaped with ``tc``'s token bucket filter (``tbf``) on both ends, so a node's rate
  holds for what it sends and for what it receives (the kernel here has no ``netem``: bandwidth
  can be limited, latency cannot be added);
- ``cut`` sets the node's switch port down (its own interface keeps its address, as a node whose
  cable is pulled does), ``heal`` sets it up again.

The tear-down deletes the namespaces (killing what still runs in them) and the hosts files; it
runs on leaving the context manager, at exit, and on SIGTERM or SIGHUP, and may run any number of
times. A cluster's id carries the id of the process that built it, so ``cleanup`` can tell what a
dead process left behind from a live cluster. Everything needs root.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

#: every cluster's id starts with this, so ``cleanup`` can find what is ours
PREFIX = "lpcluster-"
#: where ``ip netns exec`` looks for a namespace's own ``/etc`` files
NETNS_ETC = Path("/etc/netns")
#: the programs the cluster runs
TOOLS = ("ip", "tc", "unshare", "hostname")
#: what a node's process inherits from a launcher we may run under and must not pass on
LAUNCHER_VARIABLES = re.compile(
    r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|NODE_RANK|MASTER_ADDR|MASTER_PORT"
    r"|SLURM_.*|TORCHELASTIC_.*|PL_.*|GLOO_SOCKET_IFNAME|NCCL_SOCKET_IFNAME)$"
)

_ids = count(1)


class ClusterError(RuntimeError):
    """A command that builds or changes the cluster failed."""


class ClusterUnavailable(ClusterError):
    """This machine cannot host an emulated cluster (not root, a tool missing, no namespaces)."""


def unavailable_reason() -> str | None:
    """Why no cluster can be built here (``None`` when the cheap checks pass: root and the tools).

    Whether namespaces can really be created shows only when one is: `Cluster.start` raises
    `ClusterUnavailable` then.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, tc and bind mounts of /etc/netns)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs {', '.join(missing)} (iproute2, util-linux, hostname) on PATH"
    return None


def parse_rate(rate: str | float) -> float:
    """Bits per second of a ``tc`` rate (``"1gbit"``, ``"100mbit"``, ``"500kbit"``, ``"10mbps"``) or of
    a number (Mbit/s)."""
    if isinstance(rate, int | float):
        return float(rate) * 1e6
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not match:
        raise ValueError(f"not a rate: {rate!r} (examples: 1gbit, 100mbit, 500kbit)")
    value, scale, unit = float(match[1]), match[2], match[3] or "bit"
    factor = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[scale]
    return value * factor * (8 if unit == "bps" else 1)


def tc_rate(rate: str | float) -> str:
    """The rate as ``tc`` spells it, in bit/s."""
    return f"{int(parse_rate(rate))}bit"


def tbf_burst(rate: str | float) -> int:
    """Bytes of the bucket: at least 256 KiB, and at least what the rate sends in 4 ms, so that the
    timer's granularity does not cap a fast link below its rate."""
    return max(256 * 1024, int(parse_rate(rate) / 8 / 250))


def sh(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a set-up command; a failure raises `ClusterError` with its output."""
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    return proc


@dataclass(frozen=True)
class Node:
    """One node: its host name, namespace, address, interface and the switch port it is cabled to."""

    name: str
    index: int  # 0-based: the node rank a launcher should give it
    namespace: str
    address: str
    ifname: str
    port: str  # the bridge-side end of its veth, in the switch's namespace
    rate: str


def node_name(index: int) -> str:
    """The host name of the node with 0-based index ``index``: node1, node2, ..."""
    return f"node{index + 1}"


def switch_namespace(cluster_id: str) -> str:
    return f"{cluster_id}-switch"


def port_name(name: str) -> str:
    """The switch port of node ``name`` (interface names have at most 15 characters)."""
    port = f"p-{name}"
    if len(port) > 15:
        raise ValueError(f"node name {name!r} too long for an interface name")
    return port


def hosts_file(own: str, others: Mapping[str, str]) -> str:
    """A Debian-style ``/etc/hosts``: the node's own name on 127.0.1.1, the other nodes at their addresses."""
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{own}"]
    lines += [f"{address}\t{name}" for name, address in others.items()]
    lines += ["", "::1\tlocalhost ip6-localhost ip6-loopback", "ff02::1\tip6-allnodes", "ff02::2\tip6-allrouters"]
    return "\n".join(lines) + "\n"


def node_command(node: Node, argv: Sequence[str]) -> list[str]:
    """``argv`` as run inside ``node``: its network namespace and hosts file (``ip netns exec``) and a
    UTS namespace of its own with the node's host name."""
    set_name = 'hostname "$0" && exec "$@"'
    return ["ip", "netns", "exec", node.namespace, "unshare", "--uts", "--", "sh", "-c", set_name, node.name, *argv]


def clean_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the launcher's variables it may carry (ranks, rendezvous,
    SLURM's), plus ``extra``: what a node's process should start from."""
    env = {key: value for key, value in os.environ.items() if not LAUNCHER_VARIABLES.match(key)}
    env.update(extra or {})
    return env


def shape(namespace: str, device: str, rate: str | float) -> None:
    """Limit what ``device`` (in ``namespace``) sends to ``rate`` with a token bucket filter."""
    burst = tbf_burst(rate)
    sh(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", tc_rate(rate)]
       + ["burst", str(burst), "latency", "100ms"])  # fmt: skip


def set_port(cluster_id: str, name: str, up: bool) -> None:
    """Set node ``name``'s switch port up or down (heal or cut its link)."""
    sh(["ip", "-n", switch_namespace(cluster_id), "link", "set", port_name(name), "up" if up else "down"])


def shape_node(cluster_id: str, name: str, rate: str | float) -> None:
    """Shape node ``name``'s link to ``rate`` in both directions (its interface and its switch port)."""
    node_ifname = _node_ifname(f"{cluster_id}-{name}")
    shape(f"{cluster_id}-{name}", node_ifname, rate)
    shape(switch_namespace(cluster_id), port_name(name), rate)


def _node_ifname(namespace: str) -> str:
    """The one interface of a node's namespace other than its loopback."""
    out = sh(["ip", "-n", namespace, "-o", "link", "show"]).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    names = [name for name in names if name != "lo"]
    if len(names) != 1:
        raise ClusterError(f"{namespace}: expected one interface besides lo, found {names}")
    return names[0]


class Cluster:
    """K emulated nodes (see the module's docstring); build with `start` or as a context manager.

    ``rate`` shapes every link (both directions), ``rates`` overrides it per node name (for
    example ``{"node2": "100mbit"}`` for one slower node). Addresses are ``<subnet>.1`` to
    ``<subnet>.K``.
    """

    def __init__(
        self,
        nodes: int = 2,
        *,
        rate: str | float = "1gbit",
        rates: Mapping[str, str | float] | None = None,
        subnet: str = "10.77.0",
        ifname: str = "lan0",
        prefix: str = PREFIX,
    ) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be 1..250, not {nodes}")
        self.id = f"{prefix}{os.getpid()}-{next(_ids)}"
        names = [node_name(i) for i in range(nodes)]
        unknown = set(rates or {}) - set(names)
        if unknown:
            raise ValueError(f"rates for unknown nodes {sorted(unknown)}; the nodes are {names}")
        for value in [rate, *(rates or {}).values()]:
            parse_rate(value)
        rate_of = {name: str((rates or {}).get(name, rate)) for name in names}
        self.nodes = [
            Node(name, i, f"{self.id}-{name}", f"{subnet}.{i + 1}", ifname, port_name(name), rate_of[name])
            for i, name in enumerate(names)
        ]
        self.switch = switch_namespace(self.id)
        self.processes: list[subprocess.Popen] = []
        self._started = False
        self._torn_down = False
        self._owner = os.getpid()  # a forked child must not tear down its parent's cluster
        self._lock = threading.RLock()  # re-entered by a signal's tear-down during one

    # -- building and tearing down

    def start(self) -> Cluster:
        """Build the namespaces, the bridge, the links and the hosts files; tear down what was built
        if any step fails. Raises `ClusterUnavailable` when this machine cannot host a cluster."""
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        if self._started:
            return self
        self._started = True
        _register(self)
        try:
            self._add_namespace(self.switch, unavailable_is_fatal=True)
            sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for node in self.nodes:
                self._add_node(node)
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_namespace(self, namespace: str, unavailable_is_fatal: bool = False) -> None:
        proc = sh(["ip", "netns", "add", namespace], check=False)
        if proc.returncode != 0:
            error = ClusterUnavailable if unavailable_is_fatal else ClusterError
            raise error(f"cannot create the network namespace {namespace}: {proc.stderr.strip()}")
        sh(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _add_node(self, node: Node) -> None:
        """The node's namespace, its veth to the switch, its address, shaping and hosts file."""
        self._add_namespace(node.namespace)
        sh(["ip", "-n", self.switch, "link", "add", node.port, "type", "veth", "peer", "name", node.ifname]
           + ["netns", node.namespace])  # fmt: skip
        sh(["ip", "-n", self.switch, "link", "set", node.port, "master", "br0", "up"])
        sh(["ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.ifname])
        sh(["ip", "-n", node.namespace, "link", "set", node.ifname, "up"])
        shape(node.namespace, node.ifname, node.rate)  # what the node sends
        shape(self.switch, node.port, node.rate)  # what it receives
        etc = NETNS_ETC / node.namespace
        etc.mkdir(parents=True, exist_ok=True)
        others = {other.name: other.address for other in self.nodes if other is not node}
        (etc / "hosts").write_text(hosts_file(node.name, others))
        (etc / "hostname").write_text(node.name + "\n")

    def teardown(self) -> None:
        """Kill what runs in the nodes, delete the namespaces and hosts files. Idempotent; never raises.

        Only the process that built the cluster tears it down (not a forked child at its exit). A
        tear-down re-entered by a signal during one runs in full: each step tolerates what is gone.
        """
        with self._lock:
            if self._torn_down or not self._started or os.getpid() != self._owner:
                return
            for proc in self.processes:
                _kill_group(proc)
            remove_cluster(self.id)
            self._torn_down = True
            _unregister(self)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # -- using the cluster

    def node(self, node: Node | str | int) -> Node:
        """A node by itself, its name (``"node2"``) or its 0-based index."""
        if isinstance(node, Node):
            return node
        for candidate in self.nodes:
            if node in (candidate.name, candidate.index):
                return candidate
        raise KeyError(f"no node {node!r}; the nodes are {[n.name for n in self.nodes]}")

    def run(
        self, node: Node | str | int, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``node`` (its network, hosts file and host name) with environment
        ``env`` (default: this process's, as `clean_environment` leaves it), in a session of its
        own; the tear-down kills it if it still runs. ``popen``: more `subprocess.Popen` arguments
        (``stdout``, ``cwd``, ...)."""
        self._check_running()
        command = node_command(self.node(node), argv)
        environment = dict(env) if env is not None else clean_environment()
        proc = subprocess.Popen(command, env=environment, start_new_session=True, **popen)
        self.processes.append(proc)
        return proc

    def check_output(self, node: Node | str | int, argv: Sequence[str], timeout: float = 30) -> str:
        """Run a short command inside ``node`` and return its output; a failure raises `ClusterError`."""
        self._check_running()
        proc = subprocess.run(node_command(self.node(node), argv), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise ClusterError(f"{shlex.join(argv)} on {self.node(node).name} failed: {proc.stderr.strip()}")
        return proc.stdout

    def sent_bytes(self, node: Node | str | int) -> int:
        """Bytes ``node`` has sent out of its link since the cluster was built (its interface's counter):
        what crossed between nodes, every protocol included."""
        self._check_running()
        target = self.node(node)
        shown = sh(["ip", "-n", target.namespace, "-j", "-s", "link", "show", "dev", target.ifname]).stdout
        try:
            return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise ClusterError(f"no byte counter of {target.ifname} on {target.name} in {shown[:200]!r}") from err

    def cut(self, node: Node | str | int) -> None:
        """Partition ``node`` from the others: its switch port goes down, packets to and from it are lost."""
        self._check_running()
        set_port(self.id, self.node(node).name, up=False)

    def heal(self, node: Node | str | int) -> None:
        """Undo `cut`."""
        self._check_running()
        set_port(self.id, self.node(node).name, up=True)

    def shape(self, node: Node | str | int, rate: str | float) -> None:
        """Change ``node``'s link rate (both directions) while the cluster runs."""
        self._check_running()
        target = self.node(node)
        shape(target.namespace, target.ifname, rate)
        shape(self.switch, target.port, rate)

    def _check_running(self) -> None:
        if not self._started or self._torn_down:
            raise ClusterError(f"cluster {self.id} is not running (start it first; it cannot restart)")

    def describe(self) -> str:
        """A table of the nodes, for people."""
        rows = [f"cluster {self.id} (switch namespace {self.switch})"]
        rows += [
            f"  {n.name:8} rank {n.index}  {n.address:15} {n.ifname}  {n.rate:>8}  ip netns exec {n.namespace} ..."
            for n in self.nodes
        ]
        return "\n".join(rows)


# -- removing clusters, live or left over


def namespaces() -> list[str]:
    """The names of the machine's network namespaces (``ip netns list``)."""
    out = sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cluster_ids(prefix: str = PREFIX) -> list[str]:
    """The ids of the clusters with namespaces or hosts files here."""
    pattern = re.compile(rf"^({re.escape(prefix)}\d+-\d+)-")
    found = set(namespaces())
    if NETNS_ETC.is_dir():
        found |= {path.name for path in NETNS_ETC.iterdir()}
    return sorted({match[1] for name in found if (match := pattern.match(name))})


def owner_alive(cluster_id: str) -> bool:
    """Whether the process that built the cluster (its id's number) still runs."""
    match = re.search(r"(\d+)-\d+$", cluster_id)
    return bool(match) and Path(f"/proc/{match[1]}").exists()


def remove_cluster(cluster_id: str) -> None:
    """Kill every process in the cluster's namespaces, delete them and their ``/etc/netns`` files.
    Deleting a namespace deletes its interfaces, and a veth's peer with it. Never raises."""
    own = [ns for ns in namespaces() if ns.startswith(cluster_id + "-")]
    for namespace in own:
        _kill_namespace_processes(namespace)
    for namespace in own:
        sh(["ip", "netns", "del", namespace], check=False)
    if NETNS_ETC.is_dir():
        for path in NETNS_ETC.glob(f"{cluster_id}-*"):
            shutil.rmtree(path, ignore_errors=True)


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL the processes in ``namespace``: only what a cluster's commands started can be there."""
    out = sh(["ip", "netns", "pids", namespace], check=False).stdout
    for pid in (int(word) for word in out.split() if word.isdigit()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    while sh(["ip", "netns", "pids", namespace], check=False).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process started by `Cluster.run` and its session (it leads its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def cleanup(prefix: str = PREFIX, *, include_live: bool = False) -> list[str]:
    """Remove the clusters whose builder process is gone (every one with ``include_live``); returns
    their ids."""
    removed = [cid for cid in cluster_ids(prefix) if include_live or not owner_alive(cid)]
    for cluster_id in removed:
        remove_cluster(cluster_id)
    return removed


# -- tear-down at exit and on signals

_live: list[Cluster] = []
_previous_handlers: dict[int, Any] = {}
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _register(cluster: Cluster) -> None:
    """Track a live cluster; the first one installs the exit hook and the signal handlers."""
    _live.append(cluster)
    if len(_live) == 1 and threading.current_thread() is threading.main_thread():
        for signum in _SIGNALS:
            _previous_handlers[signum] = signal.signal(signum, _on_signal)


def _unregister(cluster: Cluster) -> None:
    """Forget a torn-down cluster; the last one gives the signals back to their previous handlers."""
    if cluster in _live:
        _live.remove(cluster)
    if not _live and threading.current_thread() is threading.main_thread():
        for signum, handler in list(_previous_handlers.items()):
            signal.signal(signum, handler)
            del _previous_handlers[signum]


def teardown_all() -> None:
    """Tear down every live cluster of this process."""
    for cluster in list(_live):
        cluster.teardown()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """Tear down, then do what the signal did before (by default: die of it)."""
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    teardown_all()  # gives the handlers back
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


atexit.register(teardown_all)


# -- the command line


def _cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="number of nodes (node1 .. nodeK)")
    parser.add_argument("--rate", default="1gbit", help="every link's rate, both directions (tc syntax)")
    parser.add_argument("--slow-node", action="append", default=[], help="a node on --slow-rate (repeatable)")
    parser.add_argument("--slow-rate", default="100mbit", help="the rate of the --slow-node links")
    parser.add_argument("--subnet", default="10.77.0", help="the nodes' /24 (addresses .1 .. .K)")
    parser.add_argument("--ifname", default="lan0", help="each node's interface (for GLOO_SOCKET_IFNAME)")
    parser.add_argument("--prefix", default=PREFIX, help=f"start of the cluster's id (default {PREFIX})")


def _build(args: argparse.Namespace) -> Cluster:
    rates = {name: args.slow_rate for name in args.slow_node}
    return Cluster(args.nodes, rate=args.rate, rates=rates, subnet=args.subnet, ifname=args.ifname, prefix=args.prefix)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_prague.tools.cluster", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="build a cluster and keep it until Ctrl-C or SIGTERM")
    _cluster_options(up)
    run = commands.add_parser(
        "run",
        help="build a cluster, run a command on every node at once, tear down",
        description="In the command, {node} {node_rank} {nodes} {address} {ifname} {master} are replaced per node; "
        "NODE_RANK, GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME are set. Exit status: the worst node's.",
    )
    _cluster_options(run)
    run.add_argument("--timeout", type=float, help="kill the command after this many seconds")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    for name, helptext in (("cut", "partition a node of a running cluster"), ("heal", "undo cut")):
        sub = commands.add_parser(name, help=helptext)
        sub.add_argument("cluster_id")
        sub.add_argument("node")
    rate = commands.add_parser("shape", help="change a node's link rate in a running cluster")
    rate.add_argument("cluster_id")
    rate.add_argument("node")
    rate.add_argument("rate")
    listing = commands.add_parser("list", help="the clusters here, and whether their builder still runs")
    listing.add_argument("--prefix", default=PREFIX, help=f"cluster id prefix (default {PREFIX})")
    clean = commands.add_parser("cleanup", help="remove the clusters whose builder process is gone")
    clean.add_argument("--prefix", default=PREFIX, help=f"cluster id prefix (default {PREFIX})")
    clean.add_argument("--all", action="store_true", help="live clusters too")
    return parser.parse_args(argv)


def _substitute(argv: Iterable[str], cluster: Cluster, node: Node) -> list[str]:
    values = {
        "node": node.name,
        "node_rank": str(node.index),
        "nodes": str(len(cluster.nodes)),
        "address": node.address,
        "ifname": node.ifname,
        "master": cluster.nodes[0].name,
    }
    return [re.sub(r"\{(\w+)\}", lambda m: values.get(m[1], m[0]), arg) for arg in argv]


def _relay(prefix: str, stream: TextIO) -> None:
    """Copy a node's output to ours, each line prefixed with the node's name."""
    for line in stream:
        sys.stdout.write(f"[{prefix}] {line}")
        sys.stdout.flush()


def run_everywhere(cluster: Cluster, argv: Sequence[str], timeout: float | None = None) -> int:
    """Run ``argv`` on every node at once (see the ``run`` command); the worst exit status."""
    procs, relays = [], []
    for node in cluster.nodes:
        env = clean_environment(
            {"NODE_RANK": str(node.index), "GLOO_SOCKET_IFNAME": node.ifname, "NCCL_SOCKET_IFNAME": node.ifname}
        )
        command = _substitute(argv, cluster, node)
        proc = cluster.run(node, command, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        relay = threading.Thread(target=_relay, args=(node.name, proc.stdout), daemon=True)
        relay.start()
        procs.append(proc)
        relays.append(relay)
    deadline = None if timeout is None else time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            codes.append(124)
    for relay in relays:
        relay.join(5)
    return max(codes, key=abs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _dispatch(args)
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "up":
        with _build(args) as cluster:
            print(cluster.describe(), flush=True)
            print(
                f"cut/heal: python -m lightning_prague.tools.cluster cut {cluster.id} node2; Ctrl-C tears down",
                flush=True,
            )
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
        return 0
    if args.command == "run":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            raise SystemExit("run: no command given (python -m lightning_prague.tools.cluster run -- COMMAND ...)")
        with _build(args) as cluster:
            print(cluster.describe(), flush=True)
            return run_everywhere(cluster, command, args.timeout)
    if args.command in ("cut", "heal", "shape"):
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        if args.command == "shape":
            shape_node(args.cluster_id, args.node, args.rate)
        else:
            set_port(args.cluster_id, args.node, up=args.command == "heal")
        return 0
    if args.command == "list":
        for cluster_id in cluster_ids(args.prefix):
            print(f"{cluster_id}\t{'live' if owner_alive(cluster_id) else 'left over'}")
        return 0
    if args.command == "cleanup":
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        removed = cleanup(args.prefix, include_live=args.all)
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
