"""Both sides of a network partition, in one process: the control plane names a lost node's addresses,
a survivor drops its connections there, and a worker that hears nothing from the control plane
fences itself. (`tests/test_cluster.py` cuts a node of an emulated cluster for real.)"""

from __future__ import annotations

import socket
import time

import pytest

from lightning_prague.core.client import partition
from lightning_prague.core.client.beacon import Beacon
from lightning_prague.core.client.control import Session
from lightning_prague.core.grouping.policies import RandomPolicy
from lightning_prague.core.plane.coordinator import ControlPlane
from lightning_prague.core.protocol import ALIVE, HangRule, SessionConfig

pytestmark = pytest.mark.timeout(60)


def join(plane: ControlPlane, rank: int, host: str, addresses: list[str]) -> None:
    config = SessionConfig(world_size=4, policy=RandomPolicy(4, 2).spec())
    message = {"op": "join", "s": 1, "rank": rank, "config": config.to_wire(), "pid": 0, "host": host}
    plane.handle({**message, "addresses": addresses})


def test_the_last_departure_of_a_node_names_its_addresses_and_beats_are_answered():
    plane = ControlPlane()
    here = socket.gethostname()
    for rank, host, address in (
        (0, here, "10.9.0.1"),
        (1, here, "10.9.0.1"),
        (2, "far", "10.9.0.2"),
        (3, "far", "10.9.0.2"),
    ):
        join(plane, rank, host, [address])
    beat = {"op": "beat", "s": 1, "rank": 3, "progress": 1, "waiting": False, "busy": False, "step": 0.1}
    assert plane.handle(beat) == {3: [{"t": ALIVE}]}
    session = plane.sessions[1]
    out: dict = {}
    session.depart(2, "hung: nothing heard from it", out)
    assert "unreachable" not in out[0][0]  # rank 3 still runs on that node
    out = {}
    session.depart(3, "hung: nothing heard from it", out)
    assert out[0][0]["unreachable"] == ["10.9.0.2"] and out[0][0]["node"] == "far"
    out = {}
    session.depart(1, "its process ended", out)
    session.depart(0, "its process ended", out)
    assert not any("unreachable" in item for items in out.values() for item in items)  # the control plane's node


def test_a_survivor_drops_its_connections_to_a_lost_address_and_no_other(monkeypatch):
    monkeypatch.setattr(partition, "_loopback", lambda address: False)  # loopback is the only address here
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        assert partition.drop_connections(["10.255.255.1"], 0, "test") == 0
        assert partition.drop_connections(["127.0.0.1"], 0, "test") >= 2
        client.settimeout(5)
        assert client.recv(1) == b""  # this side of the connection ended, whatever the network does
    finally:
        for sock in (client, accepted, server):
            sock.close()


class FakeLink:
    closed = False
    close_error = None

    def __init__(self, silent_for: float) -> None:
        self.last_received = time.monotonic() - silent_for


class FakeClient:
    rank = 2
    timeout = 300.0
    address = "node1:4242"

    def __init__(self, silent_for: float) -> None:
        self.link = FakeLink(silent_for)


class Exited(Exception):
    pass


@pytest.mark.parametrize("silent_for", [5.0, 30.0])
def test_a_worker_that_hears_nothing_from_the_control_plane_beyond_its_bound_fences_itself(
    monkeypatch, capsys, silent_for
):
    def exit_(status: int) -> None:
        raise Exited(status)

    monkeypatch.setattr("lightning_prague.core.client.control.os._exit", exit_)
    beacon = Beacon(HangRule(floor=10.0))
    beacon.bump()
    beacon.bump()  # one step timed: the bound is 10 s
    session = Session(FakeClient(0.0), 1, 4, beacon, long_bound=300.0)  # type: ignore[arg-type]
    session.client.link.last_received = time.monotonic() - silent_for
    session._opened -= silent_for
    if silent_for < 10.0 + partition.MARGIN_SECONDS:
        session.check_reachable()  # under the bound: nothing happens
        return
    with pytest.raises(Exited) as exited:
        session.check_reachable()
    assert exited.value.args == (partition.FENCED_EXIT_STATUS,)
    err = capsys.readouterr().err
    assert "rank 2" in err and "cut off from the control plane at node1:4242" in err and "exit status 75" in err


@pytest.mark.parametrize(("setting", "status"), [(None, 0), ("75", 75), ("3", 3), ("not a number", 75), ("300", 75)])
def test_a_rank_the_control_plane_excludes_exits_with_the_excluded_status(monkeypatch, caplog, setting, status):
    """0 by default: the job goes on without it, and a launcher that sees another status would end or
    fail the whole job; the agent of `max_restarts` sets 75 to tell an excluded rank from a finished one."""

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr("lightning_prague.core.client.control.os._exit", exit_)
    if setting is None:
        monkeypatch.delenv(partition.EXCLUDED_EXIT_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(partition.EXCLUDED_EXIT_VARIABLE, setting)
    session = Session(FakeClient(0.0), 1, 4, Beacon(HangRule()), long_bound=300.0)  # type: ignore[arg-type]
    with pytest.raises(Exited) as exited:
        session.deliver({"t": "fenced", "reason": "no progress for 60s"})
    assert exited.value.args == (status,)
    assert f"the job goes on without it: exiting with status {status}" in caplog.text


def test_the_agent_tells_its_ranks_to_report_exclusion_as_a_failure(monkeypatch):
    import lightning_prague.strategies.launcher as launcher

    monkeypatch.delenv(partition.EXCLUDED_EXIT_VARIABLE, raising=False)
    seen: list[dict] = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, env: seen.append(env) or "proc")
    monkeypatch.setattr(launcher, "_basic_subprocess_cmd", lambda: ["python", "train.py"])
    agent = object.__new__(launcher.RankAgent)
    agent.spare, agent._spare_due, agent.previous = None, 0.0, {1: -9}
    assert agent._start(1, 1) == "proc"
    assert seen[0][partition.EXCLUDED_EXIT_VARIABLE] == str(partition.FENCED_EXIT_STATUS)
    assert seen[0][launcher.PREVIOUS_EXIT_VARIABLE] == "-9"  # the restart knows how its predecessor ended
