"""A control plane that dies mid-fit and is started again takes the job back
(`lightning_prague.core.plane.journal`, `MessageLink`'s reconnection).

Real jobs (the slow part, run side by side): four CPU workers, one long epoch (the digits in batches
of 2, 50 ms steps), the control plane SIGKILLed at a rank's 30th batch:

- under `prague` (the work queue) and `decent_adam` (gossip rounds) the supervisor is global rank 0's
  child, and rank 0 starts it again;
- under `partial_reduce` it is a plane service (`lightning-prague plane --log-dir`), started again
  by hand, as its docs say, with the same command.

Every fit returns, every batch is trained once, and the ranks end on one model. The rest are
message-level: the journal replays to the same state and numbers, and what cannot be taken back is
refused by name.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import ANY

import pytest
from helpers import CREDENTIALS, dump_stacks, free_port

from lightning_prague.core.auth import SECRET_VARIABLE
from lightning_prague.core.client.control import ControlClient
from lightning_prague.core.errors import ControlPlaneError
from lightning_prague.core.grouping.policies import make_policy
from lightning_prague.core.plane.coordinator import ControlPlane
from lightning_prague.core.plane.journal import Journal, JournaledPlane, JournalError, read_journal
from lightning_prague.core.plane.service import PLANE_VARIABLE
from lightning_prague.core.plane.supervisor import serve_plane
from lightning_prague.core.protocol import ITEM_SEQ, MESSAGE_SEQ, RESUMED, SessionConfig

SAMPLES, BATCH = 1438, 2
KILLED_AT = 30
CASES = {"prague": 1, "decent_adam": 2, "partial_reduce": 3}
SERVICE = "partial_reduce"  # its plane runs as a service of its own


def _command(strategy: str, rank: int, out: Path) -> list[str]:
    command = [sys.executable, "-m", "lightning_prague.demo.run", "--strategy", strategy, "--devices", "4"]
    command += ["--epochs", "1", "--batch-size", str(BATCH), "--step-time", "0.05", "--profile", "homogeneous"]
    command += ["--start-method", "fork", "--json", str(out / "result.json")]
    return command + ([] if strategy == SERVICE else ["--fault", f"{rank}:{KILLED_AT}:kill-plane"])


def _service(out: Path, port: int, control: int, env: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "lightning_prague.cli", "plane", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--control-port", str(control), "--log-dir", str(out / "plane")]
    log = open(out / "plane.txt", "a")  # noqa: SIM115  (the service's own output; closed with the test's folder)
    return subprocess.Popen(command, cwd=out, env=env, stdout=log, stderr=log, start_new_session=True)


@pytest.fixture(scope="module")
def restarted_jobs(tmp_path_factory) -> dict[str, tuple[int, dict[int, dict], str]]:
    """The three jobs at once: name -> (exit status, each rank's result, the job's stderr)."""
    runs, services = {}, []
    for strategy in CASES:
        out = tmp_path_factory.mktemp(strategy)
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if strategy == SERVICE:
            port, control = free_port(), free_port()
            env.update({PLANE_VARIABLE: f"127.0.0.1:{port}", SECRET_VARIABLE: "a-secret-of-this-test"})
            services.append((out, port, control, env, _service(out, port, control, env)))
        log = open(out / "log.txt", "w")  # noqa: SIM115  (a pipe could fill up)
        job = subprocess.Popen(_command(strategy, CASES[strategy], out), cwd=out, env=env, stderr=log)
        runs[strategy] = (out, log, job)
    try:
        for out, port, control, env, service in services:  # killed once the ranks have trained a while
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all((out / f"pid.{r}").exists() for r in range(4)):
                time.sleep(0.2)
            time.sleep(4.0)  # about 60 batches of each rank's 180
            service.kill()
            service.wait()
            (out / "service_killed").write_text(str(time.time()))
            time.sleep(1.0)
            services.append((out, port, control, env, _service(out, port, control, env)))  # as the docs say
            break
        results = {}
        for name, (out, log, job) in runs.items():
            try:
                job.wait(timeout=240)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {name} job did not end within 240 s:\n{dump_stacks(job, out / 'log.txt')}")
            log.close()
            ranks = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("result*.json"))}
            results[name] = (job.returncode, ranks, (out / "log.txt").read_text())
    finally:
        for _, log, job in runs.values():
            if job.poll() is None:
                job.kill()
            log.close()
        for *_, service in services:
            if service.poll() is None:
                service.send_signal(signal.SIGTERM)
                service.wait(10)
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(CASES))
def test_a_control_plane_killed_mid_fit_and_started_again_takes_the_job_back(restarted_jobs, strategy):
    status, results, stderr = restarted_jobs[strategy]
    assert status == 0, stderr[-4000:]
    assert sorted(results) == [0, 1, 2, 3], stderr[-4000:]
    assert stderr.count("reconnected to the control plane") >= 4, stderr[-4000:]  # every rank's link came back
    if strategy != SERVICE:
        assert "restarted the supervisor" in stderr  # by global rank 0
    # every batch trained once, before and after the restart, and one model at the end
    trained = sum(results[r]["batches_this_process"] for r in results)
    if strategy == "decent_adam":  # lock-step shards, each of the 4 padded to the same length
        assert trained == 4 * math.ceil(math.ceil(SAMPLES / 4) / BATCH)
    else:  # the work queue: one pass over the data
        assert trained == math.ceil(SAMPLES / BATCH), {r: results[r]["batches_this_process"] for r in results}
    assert len({results[r]["params_sha256"] for r in results}) == 1


# -- message level --------------------------------------------------------------------------------
WORLD = 3


def _config() -> dict:
    return SessionConfig(WORLD, make_policy("random", WORLD, 2, seed=1).spec()).to_wire()


def _traffic(plane: JournaledPlane) -> list[dict]:
    """A fit's first steps: three ranks connect and join, claim from the work queue, ask for groups."""
    out = []
    for rank in range(WORLD):
        out.append(plane.on_connect(rank, {"op": "hello", "rank": rank}))
    seq = dict.fromkeys(range(WORLD), 0)

    def send(rank: int, op: str, **fields) -> None:
        seq[rank] += 1
        out.append(plane.handle({"op": op, "s": 1, "rank": rank, MESSAGE_SEQ: seq[rank], **fields}))

    for rank in range(WORLD):
        send(rank, "join", config=_config(), pid=100 + rank, host="elsewhere")
    for step in range(5):
        for rank in range(WORLD):
            send(rank, "kv", do="claim", req=step + 1, key="q", first=0, ticketed=0)
            send(rank, "ready", req=100 + step)
    return out


def test_a_plane_replayed_from_its_journal_stands_where_the_dead_one_stood(tmp_path):
    path = tmp_path / "journal"
    first = JournaledPlane(ControlPlane(), Journal(path, CREDENTIALS.launch))
    _traffic(first)
    _, entries = read_journal(path, CREDENTIALS.launch)
    second = JournaledPlane(ControlPlane())
    second.replay(entries)
    assert second.issued == first.issued and second.handled == first.handled
    assert {r: list(q) for r, q in second.ring.items()} == {r: list(q) for r, q in first.ring.items()}
    # the next message gets the same answer, with the same numbers, from both
    message = {"op": "kv", "s": 1, "rank": 2, MESSAGE_SEQ: first.handled[2] + 1, "do": "claim", "req": 77}
    message.update(key="q", first=0, ticketed=0)
    assert first.handle(dict(message)) == second.handle(dict(message))
    # a message handled before (sent again by a link that reconnected) changes nothing
    assert second.handle({**message, MESSAGE_SEQ: 1}) == {}


def test_a_resumed_link_learns_what_was_handled_and_gets_what_it_missed():
    plane = JournaledPlane(ControlPlane())
    _traffic(plane)
    issued = plane.issued[1]
    (resumed, *missed) = plane.on_connect(1, {"op": "hello", "rank": 1, "got": issued - 2})[1]
    assert resumed == {"t": RESUMED, "handled": plane.handled[1]}
    assert [item[ITEM_SEQ] for item in missed] == [issued - 1, issued]


@pytest.mark.parametrize("case", ["unknown rank", "got too many", "gone"])
def test_a_link_that_cannot_be_resumed_is_refused_by_name(case):
    plane = JournaledPlane(ControlPlane())
    _traffic(plane)
    rank, got = (5, 0) if case == "unknown rank" else (1, plane.issued[1] + 3 if case == "got too many" else 0)
    if case == "gone":
        plane.on_disconnect(1)
    (answer,) = plane.on_connect(rank, {"op": "hello", "rank": rank, "got": got})[rank]
    assert answer["t"] == RESUMED and "handled" not in answer
    expected = {
        "unknown rank": "has no record of it",
        "got too many": "its journal lacks what the last one did",
        "gone": "its connection closed while this control plane ran",
    }[case]
    assert expected in answer["error"] and f"rank {rank} cannot resume" in answer["error"]


def test_a_journal_is_untrusted_input(tmp_path):
    path = tmp_path / "journal"
    plane = JournaledPlane(ControlPlane(), Journal(path, CREDENTIALS.launch))
    _traffic(plane)
    with pytest.raises(JournalError, match="of launch .* not 'another-launch': another job's"):
        read_journal(path, "another-launch")
    lines = path.read_bytes().split(b"\n")
    cut = tmp_path / "cut"  # the plane died writing its last line: ignored
    cut.write_bytes(b"\n".join(lines[:-1]) + b'\n{"k":"msg","msg":{"op":"rea')
    assert len(read_journal(cut, CREDENTIALS.launch)[1]) == len(lines) - 2
    bad = {  # a line that is no entry, and a message no rank would send, refuse the recovery by line
        "not an entry": b'{"k":"pickle","data":"gASV"}',
        "unknown field": b'{"k":"msg","msg":{"op":"leave","s":1,"rank":0,"evil":1}}',
        "not JSON": b"\x80\x04\x95",
    }
    for why, line in bad.items():
        path.write_bytes(b"\n".join([*lines[:3], line, *lines[3:]]))
        with pytest.raises(JournalError, match="line 4") as raised:
            read_journal(path, CREDENTIALS.launch)
        assert raised.value is not None, why


@pytest.mark.timeout(60)
def test_a_link_reconnects_to_a_plane_started_again_and_nothing_it_sent_is_lost_or_handled_twice(tmp_path):
    journal = tmp_path / "journal"
    server = serve_plane("127.0.0.1", 0, CREDENTIALS, journal=journal)
    port = server.address[1]
    client = ControlClient("127.0.0.1", port, 0, 10.0, CREDENTIALS, reconnect_within=20.0)
    config = SessionConfig(2, make_policy("random", 2, 2, seed=1).spec())
    session = client.open_session(1, config)
    assert [session.counters.add("c", 1) for _ in range(3)] == [1, 2, 3]
    server.close()  # the plane dies (its connections close)
    deadline = time.monotonic() + 10
    while not client.link.reconnecting and time.monotonic() < deadline:
        time.sleep(0.05)
    session.send("stop", reason="request")  # sent while it is away: kept, and sent once it is back
    server = serve_plane("127.0.0.1", port, CREDENTIALS, journal=journal, recover=True)
    try:
        assert session.counters.add("c", 1) == 4  # counted once: the plane stands where it stood
        assert client.link.reconnects == 1 and not client.closed
        assert session.stop_reason == "request"  # the message sent meanwhile was handled
    finally:
        session.beacon.stop()
        client.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_plane_that_does_not_come_back_within_the_wait_is_lost(tmp_path):
    server = serve_plane("127.0.0.1", 0, CREDENTIALS)
    client = ControlClient("127.0.0.1", server.address[1], 0, 10.0, CREDENTIALS, reconnect_within=1.0)
    session = client.open_session(1, SessionConfig(2, make_policy("random", 2, 2, seed=1).spec()))
    try:
        server.close()
        with pytest.raises(ControlPlaneError, match="closed the connection.* and did not come back within 1s"):
            for _ in range(100):
                session.counters.add("c", 1)
                time.sleep(0.1)
    finally:
        session.beacon.stop()
        client.close()


def test_a_plane_taken_back_renews_an_admissions_epoch_and_decided_rounds_keep_theirs(tmp_path):
    """The groups of an admission's membership epoch met in the store that died with the plane: the
    plane taken back opens a new epoch with the same members, and gossip rounds after those decided use it."""
    path = tmp_path / "journal"
    first = JournaledPlane(ControlPlane(), Journal(path, CREDENTIALS.launch))
    _traffic(first)
    first.on_disconnect(2)  # rank 2 is lost, and a new process of it is admitted (membership epoch 1)
    first.on_connect(2, {"op": "hello", "rank": 2})
    joined = first.handle(
        {"op": "join", "s": 1, "rank": 2, MESSAGE_SEQ: 1, "config": _config(), "pid": 9, "host": "h", "rejoin": True}
    )
    assert [item["epoch"] for item in joined[2] if item["t"] == "admit"] == [1]

    def ask(plane: JournaledPlane, rank: int, round_index: int) -> dict:
        message = {"op": "round", "s": 1, "rank": rank, MESSAGE_SEQ: plane.handled[rank] + 1, "key": "g"}
        (answer,) = plane.handle({**message, "round": round_index, "slots": [0, 1]})[rank]
        return answer

    assert ask(first, 0, 5)["epoch"] == 0  # decided before the plane died
    second = JournaledPlane(ControlPlane())
    second.replay(read_journal(path, CREDENTIALS.launch)[1])
    before = dict(second.issued)
    second.took_back()
    for rank in range(WORLD):
        (renewed,) = [second.ring[rank][-1]]
        assert renewed["t"] == "members" and renewed["epoch"] == 2 and renewed["joined"] == []
        assert renewed[ITEM_SEQ] == before[rank] + 1  # behind everything issued before: the links resume to it
    assert ask(second, 1, 5)["epoch"] == 0  # the same answer as rank 0 got from the old plane
    assert ask(second, 1, 6) == {"t": "round", "key": "g", "members": [0, 1], "epoch": 2, "s": 1, ITEM_SEQ: ANY}


@pytest.mark.parametrize(("option", "variable"), [(-1, "-1"), ("60", "sixty"), (True, "1e9"), (1e9, "")])
def test_a_wait_for_the_plane_that_no_fit_could_use_is_refused_by_name(option, variable, monkeypatch):
    from lightning_prague.core.errors import ConfigurationError
    from lightning_prague.core.job import PLANE_WAIT_VARIABLE, plane_wait
    from lightning_prague.strategies.options import StrategyOptions

    with pytest.raises(ConfigurationError, match=r"plane_wait=.* is invalid: it must be the seconds \(0 to 86400\)"):
        StrategyOptions(plane_wait=option)
    if variable:
        monkeypatch.setenv(PLANE_WAIT_VARIABLE, variable)
        with pytest.raises(ConfigurationError, match=f"{PLANE_WAIT_VARIABLE}='{variable}' is invalid"):
            plane_wait()


def test_the_wait_for_the_plane_comes_from_the_option_else_the_environment(monkeypatch):
    from lightning_prague.core.job import PLANE_WAIT_SECONDS, PLANE_WAIT_VARIABLE, plane_wait
    from lightning_prague.strategies import PartialAllReduceStrategy

    monkeypatch.delenv(PLANE_WAIT_VARIABLE, raising=False)
    assert plane_wait() == PLANE_WAIT_SECONDS == 60.0
    monkeypatch.setenv(PLANE_WAIT_VARIABLE, "12.5")
    assert plane_wait() == 12.5
    assert PartialAllReduceStrategy(plane_wait=0).plane_wait == 0


def test_a_journal_is_compacted_between_fits_and_still_takes_the_job_back(tmp_path, monkeypatch):
    from lightning_prague.core.plane import journal as journal_module

    monkeypatch.setattr(journal_module, "COMPACT_AFTER", 10)
    path = tmp_path / "journal"
    first = JournaledPlane(ControlPlane(), Journal(path, CREDENTIALS.launch))
    _traffic(first)
    for rank in range(WORLD):  # the fit ends: no session open
        first.handle({"op": "close", "s": 1, "rank": rank, MESSAGE_SEQ: first.handled[rank] + 1})
    assert not first.plane.sessions
    first.handle(
        {"op": "join", "s": 2, "rank": 0, MESSAGE_SEQ: first.handled[0] + 1, "config": _config()}
        | {"pid": 1, "host": "h"}
    )  # the next fit's first message: the file now holds its header, a base and it
    _, entries = read_journal(path, CREDENTIALS.launch)
    assert [entry["k"] for entry in entries] == ["base", "msg"]
    second = JournaledPlane(ControlPlane())
    second.replay(entries)
    assert second.issued == first.issued and second.handled == first.handled and list(second.plane.sessions) == [2]
