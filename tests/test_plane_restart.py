"""A control plane that dies mid-fit and is started again takes the job back
(`lightning_prague.core.plane.journal`, `MessageLink`'s reconnection).

The real jobs share the launched jobs of other tests (process start-up dominates the suite's time):
`test_rejoin_any_step.py` SIGKILLs the supervisor of a `prague` job and of a `decent_adam` job after a
rank rejoined (global rank 0 starts it again), and `test_plane_service.py` a plane service that its
manager starts again with the same command: every fit returns, every batch is trained once, the
admission's membership epoch is renewed in the new store, and the ranks end on one model. Here: a
link against a real plane that dies and comes back, and the message level: the journal replays to the
same state and numbers, it is untrusted input, and what cannot be taken back is refused by name.
"""

from __future__ import annotations

import time
from unittest.mock import ANY

import pytest
from helpers import CREDENTIALS

from lightning_prague.core.client.control import ControlClient
from lightning_prague.core.errors import ControlPlaneError
from lightning_prague.core.grouping.policies import make_policy
from lightning_prague.core.plane.coordinator import ControlPlane
from lightning_prague.core.plane.journal import Journal, JournaledPlane, JournalError, read_journal
from lightning_prague.core.plane.supervisor import serve_plane
from lightning_prague.core.protocol import ITEM_SEQ, MESSAGE_SEQ, RESUMED, SessionConfig

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
    first.flush()  # (the server does it before it sends anything)
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
    plane.flush()
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
        session.close()
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
        session.close()  # (its watch thread would end this process once the lost plane's bound passed)
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
    first.flush()
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
    first.flush()
    _, entries = read_journal(path, CREDENTIALS.launch)
    assert [entry["k"] for entry in entries] == ["base", "msg"]
    second = JournaledPlane(ControlPlane())
    second.replay(entries)
    assert second.issued == first.issued and second.handled == first.handled and list(second.plane.sessions) == [2]


@pytest.mark.parametrize(
    "line",
    [
        b'{"op":"hello","rank":1,"nonce":"' + b"a" * 64 + b'","proof":"' + b"b" * 64 + b'","got":-1}',
        b'{"op":"hello","rank":1,"nonce":"' + b"a" * 64 + b'","proof":"' + b"b" * 64 + b'","got":"all"}',
        b'{"op":"leave","s":1,"rank":1,"m":0}',
        b'{"op":"leave","s":1,"rank":1,"m":"1"}',
        b'{"op":"leave","s":1,"rank":1,"m":1.5}',
    ],
)
def test_a_resume_or_a_message_number_that_no_link_would_send_is_refused_on_the_wire(line):
    from lightning_prague.core.protocol import BadMessage, decode_message

    with pytest.raises(BadMessage, match="'got'|'m'"):
        decode_message(line)


# -- one plane at a time, and who starts a dead one again ----------------------------------------------
def _hold_in_child(journal) -> int:
    """A forked process that holds `journal`'s lock until it is killed; its pid once it holds it."""
    import os

    from lightning_prague.core.plane.journal import hold_journal, journal_in_use

    pid = os.fork()
    if pid == 0:
        try:
            hold_journal(journal)
            time.sleep(60)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 10
    while journal_in_use(journal) is not True:
        assert time.monotonic() < deadline, "the child never held the journal's lock"
        time.sleep(0.01)
    return pid


def _kill(pid: int) -> None:
    import os
    import signal

    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_a_journal_serves_one_plane_at_a_time_and_a_killed_holder_frees_it(tmp_path):
    """A second plane on a journal in use is refused, naming the holder's pid; the lock of a process
    killed with SIGKILL is free at once (no stale pid file to clean up)."""
    from lightning_prague.core.plane.journal import hold_journal, journal_in_use, release_journal

    journal = tmp_path / "plane.journal"
    assert journal_in_use(journal) is None  # no plane ever journaled here
    holder = _hold_in_child(journal)
    try:
        with pytest.raises(JournalError, match=f"another control plane \\(pid {holder}\\) uses the journal"):
            serve_plane("127.0.0.1", 0, CREDENTIALS, journal=journal, recover=True)
    finally:
        _kill(holder)
    assert journal_in_use(journal) is False
    hold_journal(journal)  # the next plane takes it
    try:
        assert journal_in_use(journal) is True
    finally:
        release_journal(journal, delete=True)
    assert journal_in_use(journal) is None


def test_a_later_process_of_rank_0_adopts_the_supervisor_and_tells_when_it_died(tmp_path):
    """Global rank 0's new process (one that rejoined) derives the journal its first process's supervisor
    keeps, from the same folder, port and launch, and takes the supervisor for dead only once no process
    holds that journal; it starts it again with the same command, taking the job back (`--recover`)."""
    from lightning_prague.core.plane.launch import adopt, journal_path

    options = dict(secret=b"s", launch_id="slurm:42", wait=30.0, publish_secret=True, log_dir=tmp_path)
    handle = adopt(4242, "127.0.0.1", 29500, 4, 30.0, True, **options)
    assert handle.adopted and handle.journal == journal_path(tmp_path, 29500, "slurm:42")
    assert journal_path(tmp_path, 29500, "slurm:43") != handle.journal  # another launch: another journal
    argv = handle.argv
    assert argv[argv.index("--journal") + 1] == str(handle.journal) and "--publish-secret" in argv
    assert not handle.dead()  # no journal here: nothing to start again
    holder = _hold_in_child(handle.journal)
    try:
        assert not handle.dead()
    finally:
        _kill(holder)
    assert handle.dead()
