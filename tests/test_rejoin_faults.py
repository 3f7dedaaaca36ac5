"""The rejoin path's own faults never cost the job: each case sent to the real `ControlPlane`.

A joiner (a new process for a lost rank) may die or give up before its admission, after it, or
while the donor sends it the fit's state; an earlier process of its rank may have closed its
session; a departed rank's late claims may still be in flight. In every case the members must not
wait for it, the next process of that rank must be able to rejoin, and a departed rank's messages
must take no work. One process-level case checks that a rank's new process gets nothing that was
meant for its predecessor.
"""

from __future__ import annotations

import time

import pytest
from helpers import CREDENTIALS

from lightning_prague.core import ControlPlane, SessionConfig, make_policy
from lightning_prague.core.client.link import MessageLink
from lightning_prague.core.plane.server import MessageServer
from lightning_prague.core.protocol import REQUEUED

pytestmark = pytest.mark.timeout(60)

WORLD = 4


def config_wire(seed: int = 1) -> dict:
    return SessionConfig(WORLD, make_policy("random", WORLD, 2, seed=seed).spec()).to_wire()


def send(plane: ControlPlane, rank: int, op: str, **fields) -> dict:
    return plane.handle({"op": op, "s": 1, "rank": rank, **fields})


def join(plane: ControlPlane, rank: int, rejoin: bool = False) -> dict:
    extra = {"rejoin": True} if rejoin else {}
    return send(plane, rank, "join", config=config_wire(), pid=1000 + rank, host="elsewhere", **extra)


def arrive(plane: ControlPlane, ranks, sync: str) -> dict:
    out: dict = {}
    for rank in ranks:
        for r, items in send(plane, rank, "arrive", sync=sync).items():
            out.setdefault(r, []).extend(items)
    return out


def releases(out: dict, rank: int, sync: str) -> list[dict]:
    return [i for i in out.get(rank, []) if i["t"] == "release" and i["sync"] == sync]


@pytest.fixture
def plane_without_2() -> ControlPlane:
    """A fit of 4 ranks whose rank 2 was lost (its connection closed)."""
    plane = ControlPlane()
    for rank in range(WORLD):
        join(plane, rank)
    plane.on_disconnect(2)
    assert 2 in plane.sessions[1].departed
    return plane


def admissions(out: dict, rank: int) -> list[dict]:
    return [i for i in out.get(rank, []) if i["t"] in ("members", "admit")]


@pytest.mark.parametrize("how", ["its process ends", "it gives up"])
def test_a_joiner_gone_before_its_admission_holds_no_meeting(plane_without_2, how):
    """Held back while the members meet, the joiner dies or gives up: the meeting releases without it,
    nobody is admitted, and a later process of rank 2 still may be."""
    plane = plane_without_2
    assert arrive(plane, [0], "epoch_end@epoch0") == {}
    assert join(plane, 2, rejoin=True) == {}  # held: a member is at a meeting
    if how == "its process ends":
        plane.on_disconnect(2)
    else:
        send(plane, 2, "close", failed=True)
    out = arrive(plane, [1, 3], "epoch_end@epoch0")
    release = releases(out, 0, "epoch_end@epoch0")[-1]
    assert release["members"] == [0, 1, 3] and "joined" not in release and 2 not in out
    for rank in (0, 1, 3):
        assert admissions(send(plane, rank, "resume"), 0) == []
    assert plane.sessions[1].generator.joining == []
    # and a later process of rank 2 may still rejoin, at once
    assert admissions(join(plane, 2, rejoin=True), 2)[0]["joined"] == [2]


@pytest.mark.parametrize("how", ["its process ends", "its state transfer fails"])
def test_a_joiner_that_fails_after_its_admission_departs_and_may_come_back(plane_without_2, how):
    plane = plane_without_2
    admitted = join(plane, 2, rejoin=True)
    assert admissions(admitted, 2)[0]["t"] == "admit"
    session = plane.sessions[1]
    assert 2 in session.members and 2 in session.generator.live
    # the joiner fails: its process ends, or its rejoin fails (the donor died mid-transfer) and it closes
    out = plane.on_disconnect(2) if how == "its process ends" else send(plane, 2, "close", failed=True)
    notices = [i for i in out[0] if i["t"] == "departed"]
    assert notices and notices[0]["rank"] == 2
    assert 2 not in session.generator.live and 2 in session.departed
    # no group is issued with it, the next meeting releases without it
    for rank in (0, 1, 3):
        for _ in range(5):
            for item in send(plane, rank, "ready", req=1).get(rank, []):
                assert item["t"] != "group" or 2 not in item["members"]
    assert releases(arrive(plane, [0, 1, 3], "epoch_end@epoch1"), 0, "epoch_end@epoch1")
    for rank in (0, 1, 3):
        send(plane, rank, "resume")
    # a new process for rank 2 is not refused as a live member: admitted, in a new membership epoch
    assert admissions(join(plane, 2, rejoin=True), 2)[0]["epoch"] == 2


def test_a_group_drawn_before_a_ranks_loss_gets_its_verdict_after_the_rank_rejoined():
    """Rank 0's group with rank 2 is issued; rank 2's process dies before it reports its sum, and a new
    process for rank 2 is admitted before rank 0 reports: rank 0 gets its verdict (against) at once,
    not at its timeout (the new process never takes part in its predecessor's group)."""
    plane = ControlPlane()
    for rank in range(WORLD):
        join(plane, rank)
    groups = []
    for req in range(1, 20):
        groups += [i for i in send(plane, 0, "ready", req=req).get(0, []) if i["t"] == "group" and 2 in i["members"]]
        if groups:
            break
        for rank in (1, 3):  # (each runs what it was drawn into: with `avoid_busy` busy ranks are not drawn)
            send(plane, rank, "ready", req=req)
    group = groups[0]
    plane.on_disconnect(2)
    assert admissions(join(plane, 2, rejoin=True), 2)[0]["epoch"] > group["e"]
    out = send(plane, 0, "summed", key=f"g{group['gid']}", members=group["members"], ok=True, epoch=group["e"])
    assert [i["apply"] for i in out[0] if i["t"] == "verdict"] == [False]


def test_a_rank_readmitted_after_an_earlier_process_closed_departs_when_it_crashes(plane_without_2):
    plane = plane_without_2
    session = plane.sessions[1]
    session.closed.add(2)  # an earlier process of rank 2 had closed its session before it was lost
    join(plane, 2, rejoin=True)
    assert 2 in session.members and 2 not in session.closed
    out = plane.on_disconnect(2)
    assert any(i["t"] == "departed" and i["rank"] == 2 for i in out[0])


def test_a_normal_close_at_the_fit_end_is_no_departure():
    plane = ControlPlane()
    for rank in range(WORLD):
        join(plane, rank)
    arrive(plane, range(WORLD), "fit_end")
    out = send(plane, 0, "close")
    assert not any(i["t"] == "departed" for items in out.values() for i in items)
    assert plane.sessions[1].departed == {}


def claim(plane: ControlPlane, rank: int, req: int, key: str = "queue@0", park: bool = False) -> dict:
    return send(plane, rank, "kv", req=req, do="claim", key=key, first=0, num=8, park=park)


def test_a_departed_ranks_late_claim_takes_no_chunk_and_its_chunks_go_back_once():
    plane = ControlPlane()
    for rank in range(WORLD):
        join(plane, rank)
    session = plane.sessions[1]
    assert claim(plane, 1, 1)[1][0]["value"][0] == 0  # rank 1 holds chunk 0
    plane.on_disconnect(1)  # lost: chunk 0 goes back to the queue
    assert session.values["queue@0" + REQUEUED] == [[0, None]]
    late = claim(plane, 1, 2)  # its claim in flight when it was declared lost: the queue is at its end
    assert late[1][0]["value"] == [8, None] and "error" not in late[1][0]
    assert session.values["queue@0" + REQUEUED] == [[0, None]]  # the requeued chunk is still there
    assert claim(plane, 3, 3)[3][0]["value"][0] == 0  # a member gets it
    # a departed rank's work report or verdict changes nothing; its parked claim waits for nothing
    late_messages = [("work", {"key": "queue@0", "done": [0]}), ("summed", {"key": "g", "members": [1, 3], "ok": 1})]
    for op, fields in late_messages:
        assert send(plane, 1, op, **fields) == {}
    assert claim(plane, 1, 4, park=True)[1][0]["value"] == [8, None]
    assert session.ends.parked("queue@0") == []
    other = send(plane, 1, "kv", req=5, do="add", key="progress", amount=1)  # anything else: refused
    assert "not a member" in other[1][0]["error"]
    assert 1 not in session.work.holders("queue@0")


def test_a_new_process_gets_nothing_meant_for_its_lost_predecessor():
    """Items routed to a rank whose connection closed are dropped, not queued for the next process
    that proves that rank (which would find them before it opened its session, and drop them)."""

    def handler(message: dict) -> dict:  # every message of rank 0 also sends rank 2 an admission
        admission = {"t": "admit", "epoch": 1, "members": [0, 1, 2], "donor": 0, "s": 1}
        return {2: [admission], 0: [{"t": "reply", "req": message["req"]}]}

    server = MessageServer(handler, "127.0.0.1", CREDENTIALS)
    server.start()
    try:
        first = MessageLink(*server.address, 2, timeout=10, credentials=CREDENTIALS)
        first.send({"op": "echo", "rank": 2, "item": {"t": "first"}})
        assert first.receive(timeout=10) == {"t": "first"}
        first.close()
        assert _wait(lambda: 2 not in server.connected)
        other = MessageLink(*server.address, 0, timeout=10, credentials=CREDENTIALS)
        other.send({"op": "kv", "s": 1, "rank": 0, "req": 1, "do": "get", "key": "k"})
        assert other.receive(timeout=10) == {"t": "reply", "req": 1}
        assert server.messages_dropped == 1
        second = MessageLink(*server.address, 2, timeout=10, credentials=CREDENTIALS)
        second.send({"op": "echo", "rank": 2, "item": {"t": "second"}})
        assert second.receive(timeout=10) == {"t": "second"}  # nothing of the first's came before it
        for link in (second, other):
            link.close()
    finally:
        server.close()


def _wait(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


# -- admission with no meeting -----------------------------------------------------------------------
def test_a_joiner_is_admitted_between_two_groups_of_every_members_sequence(plane_without_2):
    """No meeting: the members get the membership epoch in their inbox order, the joiner its admission
    (the donor, the members, where its rank stood); every group issued before it comes before it."""
    plane = plane_without_2
    before = send(plane, 0, "ready", req=1)
    admitted = join(plane, 2, rejoin=True)
    after = send(plane, 1, "ready", req=1)
    assert [i["t"] for i in admissions(admitted, 0)] == ["members"] and admissions(before, 0) == []
    assert admitted[2][0]["donor"] == 0 and admitted[2][0]["members"] == [0, 1, 2, 3]
    assert all(i["t"] != "members" for items in after.values() for i in items)
    assert plane.sessions[1].members == {0, 1, 2, 3}


def test_a_joiner_and_a_meeting_admitted_after_its_commit_the_sub_meetings_never_wait_for_it(plane_without_2):
    plane = plane_without_2
    arrive(plane, [0, 1], "epoch_end@epoch0")
    assert join(plane, 2, rejoin=True) == {}
    arrive(plane, [3], "epoch_end@epoch0")
    committed = arrive(plane, [0, 1, 3], "epoch_end@epoch0/commit")
    assert releases(committed, 0, "epoch_end@epoch0/commit") and 2 not in committed
    assert 2 not in send(plane, 0, "resume") and 2 not in send(plane, 1, "resume")
    assert admissions(send(plane, 3, "resume"), 2)[0]["t"] == "admit"


def test_a_departed_ranks_late_round_question_is_dropped(plane_without_2):
    plane = plane_without_2
    assert send(plane, 2, "round", key="m3.2", round=3, slots=[2, 3]) == {}
    answer = send(plane, 3, "round", key="m3.2", round=3, slots=[2, 3])[3][0]
    assert answer["members"] == [3]  # (rank 2 was lost before any round was decided with it)


def test_an_admitted_rank_is_drawn_into_no_group_until_it_trains(plane_without_2):
    """A joiner restores the fit's state after its admission: a member that drew it into a group then
    would wait on it (and a member that waits there holds every meeting). Nobody draws it until its
    first claim on the work queue or its first group request."""
    plane = plane_without_2
    join(plane, 2, rejoin=True)
    drawn = lambda: [  # noqa: E731
        item["members"]
        for rank in (0, 1, 3)
        for req in range(1, 9)
        for item in send(plane, rank, "ready", req=req).get(rank, [])
        if item["t"] == "group"
    ]
    assert drawn() and not any(2 in members for members in drawn())
    generator = plane.sessions[1].generator
    assert generator.starting == {2}
    claim(plane, 2, 1)  # it trains: its loader claims its first batch
    assert generator.starting == set()  # (others may draw it now, as the lagging rule allows)


def test_a_round_question_about_a_rank_outside_the_fit_is_refused_to_its_sender_alone(plane_without_2):
    plane = plane_without_2
    out = send(plane, 0, "round", key="m3.0", round=3, slots=[0, 9])  # a world of 4: rank 9 is no rank of it
    assert list(out) == [0] and out[0][0]["t"] == "error" and "outside the fit" in out[0][0]["message"]
    answer = send(plane, 1, "round", key="m3.1", round=3, slots=[1, 3])[1][0]  # the plane serves on
    assert answer["t"] == "round" and answer["members"] == [1, 3]
