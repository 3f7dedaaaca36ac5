"""A replica's followers get its leader's answers from the work queue (`FollowedClaims`), taking nothing.

The control plane's side is driven message by message (`CoordinatorSession`, as `test_queue_end.py`
does); the client's (`Counters.begin_claim(follow=...)`), a hostile `follow` and a plane rebuilt from
its journal are tried against a real plane.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import CREDENTIALS

from lightning_prague.core import ControlClient, ControlPlane, SessionConfig, make_policy
from lightning_prague.core.client.link import MessageLink
from lightning_prague.core.errors import ControlPlaneError
from lightning_prague.core.plane.coordinator import CoordinatorSession
from lightning_prague.core.plane.journal import Journal, JournaledPlane, read_journal
from lightning_prague.core.plane.queue_end import MAX_FOLLOWED, MAX_PARKED_PER_RANK, MAX_QUEUES, FollowedClaims
from lightning_prague.core.plane.server import BadMessage, MessageServer, decode_message
from lightning_prague.core.protocol import MESSAGE_SEQ, REQUEUED

pytestmark = pytest.mark.timeout(60)

KEY = "epoch/0/cursor"
NUM = 8  # chunks 0-3 are set aside for ranks 0-3, the queue hands out 4-7
LEADER, FOLLOWER = 0, 1  # one replica (ranks 0 and 1); ranks 2 and 3 claim for themselves


def session_of(world: int = 4) -> CoordinatorSession:
    session = CoordinatorSession(1, SessionConfig(world, make_policy("random", world, 2).spec()))
    session.members.update(range(world))
    return session


def claim(session: CoordinatorSession, rank: int, req: int, out: dict, first_claim: bool = False, **extra) -> None:
    message = {"do": "claim", "key": KEY, "first": 4, "ticketed": NUM, "tickets": "t", "num": NUM, "park": True}
    if first_claim:
        message.update(members=[0, 1, 2, 3], preset=[0, 1, 2, 3])
    session.kv(rank, req, {**message, **extra}, out)


def follow(session: CoordinatorSession, req: int, n: int, out: dict, rank: int = FOLLOWER, leader: int = LEADER):
    """`rank`'s claim that follows answer `n` of `leader` (it sends a claim's fields, which are not used)."""
    claim(session, rank, req, out, follow=[leader, n])


def replies(out: dict, rank: int) -> dict[int, object]:
    """req -> the value (or `("error", message)`) of each reply `rank` got."""
    got = {}
    for item in out.get(rank, []):
        if item["t"] == "reply":
            got[item["req"]] = ("error", item["error"]) if "error" in item else item["value"]
    return got


def refused(session: CoordinatorSession, rank: int, req: int, message: dict) -> str:
    """The error reply the control plane gives `rank`'s request (the plane's handler turns what the
    session raises into the sender's error reply)."""
    plane = ControlPlane()
    plane.sessions[session.number] = session
    out = plane.handle({"op": "kv", "s": session.number, "rank": rank, "req": req, **message})
    (item,) = out[rank]
    assert item["t"] == "reply" and item["req"] == req and "value" not in item, item
    return item["error"]


def test_a_follower_gets_the_leaders_answers_in_order_given_or_waited_for():
    session = session_of()
    out: dict = {}
    follow(session, 1, 0, out)  # before the leader claimed anything: it waits
    assert replies(out, FOLLOWER) == {}
    claim(session, LEADER, 1, out, first_claim=True)
    assert replies(out, LEADER) == {1: [4, 1]}
    assert replies(out, FOLLOWER) == {1: [4, 1]}, "the waiting follow gets the leader's answer with it"
    claim(session, 2, 1, out)
    claim(session, LEADER, 2, out)
    claim(session, LEADER, 3, out)
    assert replies(out, LEADER) == {1: [4, 1], 2: [6, 3], 3: [7, 4]}
    out = {}
    follow(session, 2, 2, out)  # answers given already: at once, the same, in the leader's order
    follow(session, 3, 1, out)
    assert replies(out, FOLLOWER) == {2: [7, 4], 3: [6, 3]}
    assert session.followed.kept(KEY, LEADER) == (0, 3) and session.followed.kept(KEY, 2) == (0, 1)


def test_a_follow_takes_nothing_from_the_queue():
    session = session_of()
    out: dict = {}
    claim(session, LEADER, 1, out, first_claim=True)
    before = (dict(session.values), session.work.holders(KEY), session.requeued_work())
    follow(session, 1, 0, out)
    follow(session, 2, 1, out, rank=3, leader=2)  # (waits: rank 2 claimed nothing yet)
    assert replies(out, FOLLOWER) == {1: [4, 1]}
    assert (dict(session.values), session.work.holders(KEY), session.requeued_work()) == before
    assert session.values[KEY] == 1 and session.values["t"] == 1  # one claim moved the cursor and the tickets
    assert session.work.lose(FOLLOWER) == {KEY: [(1, -2)]}  # its set-aside chunk only, not the leader's 4
    assert session.work.lose(LEADER) == {KEY: [(0, -3), (4, 1)]}


def test_chunks_a_lost_member_gave_back_and_the_queues_end_are_followed_too():
    session = session_of(world=3)  # ranks 0 (leader) and 1 (follower) are a replica; rank 2 claims alone
    members = {"members": [0, 1, 2], "preset": [0, 1, 2]}
    out: dict = {}
    claim(session, LEADER, 1, out, **members)  # 4
    claim(session, 2, 1, out)  # 5
    claim(session, LEADER, 2, out)  # 6 (7 is the queue's last)
    session.report_work(LEADER, {"key": KEY, "done": [0, 4, 6]})
    session.report_work(FOLLOWER, {"key": KEY, "done": [1]})
    out = {}
    follow(session, 1, 2, out)  # the leader's next answer: it waits for it
    claim(session, LEADER, 3, out, standby=True)  # the leader left the tail: it stands by
    assert replies(out, LEADER) == {} and replies(out, FOLLOWER) == {}
    session.depart(2, "killed", out)  # rank 2's chunks 2 and 5 go back: the leader takes the first
    assert replies(out, LEADER) == {3: [2, 0]} and replies(out, FOLLOWER) == {1: [2, 0]}
    assert session.work.holders(KEY) == {LEADER}  # the follower took nothing (it trained its set-aside chunk)
    out = {}
    follow(session, 2, 3, out)
    claim(session, LEADER, 4, out, standby=True)  # standing by: the next chunk rank 2 gave back
    assert replies(out, LEADER) == {4: [5, 2]} and replies(out, FOLLOWER) == {2: [5, 2]}
    out = {}
    claim(session, LEADER, 5, out)  # the queue's last chunk (with the ticket rank 2 would have had)
    claim(session, LEADER, 6, out)  # the queue's end: nobody else claims (rank 2 is lost, rank 1 follows)
    end = replies(out, LEADER)[6]
    assert replies(out, LEADER) == {5: [7, 4], 6: end} and end[0] >= NUM and end[1] is None
    follow(session, 3, 5, out)
    follow(session, 4, 4, out)
    assert replies(out, FOLLOWER) == {3: end, 4: [7, 4]}


def test_a_standby_answer_is_followed_and_a_follow_releases_the_claim_that_waited_for_its_rank():
    """The leader left the epoch's tail and stands by while chunks are left: it takes the next once
    nobody else claims. Its follower had not followed on the queue yet, so it was waited for; its
    first follow there tells the plane it claims nothing, which releases the standby claim."""
    session = session_of(world=3)
    out: dict = {}
    claim(session, LEADER, 1, out, members=[0, 1, 2], preset=[0, 1, 2])  # 4
    claim(session, 2, 1, out)  # 5
    session.report_work(2, {"key": KEY, "done": [2, 5], "end": True})  # rank 2 left the tail, done
    session.report_work(FOLLOWER, {"key": KEY, "done": [1]})
    session.report_work(LEADER, {"key": KEY, "done": [0, 4]})
    claim(session, LEADER, 2, out, standby=True)
    assert 2 not in replies(out, LEADER), "the follower (not known as one yet) is waited for"
    follow(session, 1, 1, out)
    assert replies(out, LEADER)[2] == [6, 3] and replies(out, FOLLOWER) == {1: [6, 3]}
    follow(session, 2, 0, out)
    assert replies(out, FOLLOWER)[2] == [4, 1]
    assert session.work.holders(KEY) == {LEADER} and session.values[KEY] == 3


def test_parked_claims_do_not_wait_for_a_follower():
    session = session_of(world=3)
    members = {"members": [0, 1, 2], "preset": [0, 1, 2]}
    out: dict = {}
    claim(session, LEADER, 1, out, **members)
    claim(session, 2, 1, out)
    follow(session, 1, 0, out)
    assert replies(out, FOLLOWER) == {1: [4, 1]}
    session.report_work(FOLLOWER, {"key": KEY, "done": [1]})  # (its set-aside chunk: it holds nothing now)
    claim(session, LEADER, 2, out)
    claim(session, 2, 2, out)
    claim(session, LEADER, 3, out)  # 4..7 are out: this claim parks, waiting for rank 2 alone
    session.report_work(LEADER, {"key": KEY, "done": [0, 4, 6]})
    assert 3 not in replies(out, LEADER)
    session.report_work(2, {"key": KEY, "done": [2, 5, 7]})
    claim(session, 2, 3, out)  # every claimer is at the queue's end: the follower is not waited for
    end = replies(out, LEADER)[3]
    assert end[0] >= NUM and replies(out, 2)[3][0] >= NUM
    follow(session, 2, 2, out)
    assert replies(out, FOLLOWER)[2] == end


def test_a_follower_of_a_leader_that_departs_gets_an_error_at_once():
    session = session_of()
    out: dict = {}
    claim(session, LEADER, 1, out, first_claim=True)
    follow(session, 1, 1, out)  # waits for the leader's second answer
    follow(session, 1, 0, out, rank=3, leader=2)  # another replica's follower: unaffected
    session.depart(LEADER, "killed", out)
    ((kind, error),) = replies(out, FOLLOWER).values()
    assert kind == "error" and "rank 0, the leader of its replica, left the job (killed)" in error
    assert session.followed.waiting(KEY) == {3: (2, 0)} and session.followed.kept(KEY, LEADER) == (0, 0)
    error = refused(session, FOLLOWER, 2, {"do": "claim", "key": KEY, "first": 4, "ticketed": 0, "follow": [0, 0]})
    assert "rank 0, the leader of its replica, left the job (killed)" in error  # already gone: refused at once
    out = {}
    claim(session, 2, 1, out)  # the other replica goes on
    assert replies(out, 3) == {1: replies(out, 2)[1]}


def test_a_follower_of_a_leader_that_closes_the_fit_gets_an_error_and_a_lost_follower_is_forgotten():
    plane = ControlPlane()
    session = plane.sessions[1] = session_of()
    out: dict = {}
    follow(session, 1, 0, out)
    follow(session, 1, 0, out, rank=3, leader=2)
    out = plane.handle({"op": "close", "s": 1, "rank": LEADER})
    ((kind, error),) = replies(out, FOLLOWER).values()
    assert kind == "error" and "rank 0, the leader of its replica, left the job (it closed the fit)" in error
    session.depart(3, "killed", out)  # a lost follower's follow is answered by nobody
    assert session.followed.waiting(KEY) == {}
    out = {}
    claim(session, 2, 1, out)
    assert 3 not in out


def test_a_follow_is_refused_for_a_leader_that_is_no_member_itself_or_an_answer_no_longer_kept():
    session = session_of()
    base = {"do": "claim", "key": KEY, "first": 4, "ticketed": 0}
    assert "cannot follow its own claims" in refused(session, 1, 1, {**base, "follow": [1, 0]})
    assert "not a live member" in refused(session, 1, 2, {**base, "follow": [9, 0]})
    session.members.discard(3)  # (never joined: a free place)
    assert "not a live member" in refused(session, 1, 3, {**base, "follow": [3, 0]})
    out: dict = {}
    for req in range(MAX_FOLLOWED + 2):  # answers 0..65: the first two are dropped
        claim(session, LEADER, req, out, park=False)
    assert session.followed.kept(KEY, LEADER) == (2, MAX_FOLLOWED + 2)
    error = refused(session, 1, 4, {**base, "follow": [0, 1]})
    assert "answer 1 of rank 0" in error and repr(KEY) in error and f"only its last {MAX_FOLLOWED}" in error
    follow(session, 5, 2, out)
    follow(session, 6, MAX_FOLLOWED + 1, out)
    assert replies(out, FOLLOWER) == {5: [6, 3], 6: [4 + MAX_FOLLOWED + 1, None]}
    assert "is at most" in refused(session, 1, 7, {**base, "follow": [0, 2 * MAX_FOLLOWED + 2]})
    follow(session, 8, MAX_FOLLOWED + 2, out)  # the next: it waits, once per rank and queue
    assert "already waits" in refused(session, 1, 9, {**base, "follow": [0, MAX_FOLLOWED + 3]})
    assert session.followed.waiting(KEY) == {1: (0, MAX_FOLLOWED + 2)}


def test_what_follows_keep_is_bounded_whatever_a_rank_sends():
    followed = FollowedClaims()
    for index in range(MAX_PARKED_PER_RANK):
        assert followed.follow(f"q{index}", 5, index, 0, 0) is None
    with pytest.raises(ValueError, match="follows of"):
        followed.follow("one more", 5, 99, 0, 0)
    for index in range(MAX_QUEUES - MAX_PARKED_PER_RANK):  # other queues only hold answers
        followed.given(f"a{index}", 0, [index, None])
    assert len(followed.keys()) == MAX_QUEUES
    followed.given("new", 0, [1, None])  # an answer is given whatever: a queue nobody waits on makes room
    assert len(followed.keys()) == MAX_QUEUES and "a0" not in followed.keys()
    with pytest.raises(ValueError, match="a0"):  # (its answers are gone: refused, never waited on)
        followed.follow("a0", 6, 1, 0, 0)
    for index in range(200):
        followed.given("new", 0, [index, None])
    assert followed.kept("new", 0) == (201 - MAX_FOLLOWED, 201)
    full = FollowedClaims()  # every queue has a follow waiting: a new follow is refused, an answer pushes one out
    for index in range(MAX_QUEUES):
        full.follow(f"w{index}", 100 + index // MAX_PARKED_PER_RANK, index, 0, 0)
    with pytest.raises(ValueError, match=f"more than {MAX_QUEUES} work queues"):
        full.follow("w-new", 1, 1, 0, 0)
    (pushed_out,) = full.given("extra", 0, [3, None])
    assert pushed_out.rank == 100 and pushed_out.req == 0 and "more than" in pushed_out.error
    assert "w0" not in full.keys() and len(full.keys()) == MAX_QUEUES


def test_deleting_the_queue_drops_its_answers_and_fails_its_waiting_follows():
    session = session_of()
    out: dict = {}
    claim(session, LEADER, 1, out, first_claim=True)
    follow(session, 1, 1, out)
    claim(session, 2, 1, out)
    claim(session, 2, 2, out)
    claim(session, 2, 3, out)  # rank 2 took the rest: its next claim parks
    claim(session, 2, 4, out)
    out = {}
    session.kv(3, 1, {"do": "delete", "key": KEY}, out)
    assert replies(out, 2) == {4: [NUM, None]}  # the parked claim returns at the queue's forgetting
    ((kind, error),) = replies(out, FOLLOWER).values()
    assert kind == "error" and "was forgotten" in error
    assert KEY not in session.followed.keys()
    assert "was forgotten" in refused(session, 1, 2, {"do": "claim", "key": KEY, "first": 4, "ticketed": 0,
                                                      "follow": [0, 0]})  # fmt: skip


def test_a_parked_claim_released_at_the_queues_forgetting_is_followed():
    session = session_of(world=2)
    out: dict = {}
    for req in range(1, 6):  # the leader takes chunks 4..7; its fifth claim parks at the queue's end
        claim(session, LEADER, req, out, members=[0, 1], preset=[0, 1])
    assert 5 not in replies(out, LEADER)
    follow(session, 1, 4, out)  # the follower still holds its set-aside chunk 1: the claim waits
    assert replies(out, FOLLOWER) == {} and session.ends.parked(KEY) == [LEADER]
    out = {}
    session.kv(1, 9, {"do": "delete", "key": KEY}, out)
    assert replies(out, LEADER)[5] == [NUM, None] and replies(out, FOLLOWER) == {1: [NUM, None], 9: True}


def test_a_rank_that_followed_and_claims_itself_is_waited_for_again():
    session = session_of(world=3)
    out: dict = {}
    claim(session, LEADER, 1, out, members=[0, 1, 2], preset=[0, 1, 2])
    follow(session, 1, 0, out)
    assert FOLLOWER in session.ends._queues[KEY].done
    claim(session, FOLLOWER, 2, out)  # its leader is gone, say: it claims for the replica now
    assert FOLLOWER not in session.ends._queues[KEY].done


def test_a_plane_rebuilt_from_its_journal_keeps_the_answers_and_the_waiting_follows(tmp_path):
    path = tmp_path / "journal"
    first = JournaledPlane(ControlPlane(), Journal(path, CREDENTIALS.launch))
    config = SessionConfig(3, make_policy("random", 3, 2, seed=1).spec()).to_wire()
    seq = dict.fromkeys(range(3), 0)

    def send(plane: JournaledPlane, rank: int, **fields) -> dict:
        seq[rank] += 1
        return plane.handle({"s": 1, "rank": rank, MESSAGE_SEQ: seq[rank], **fields})

    def kv_claim(plane: JournaledPlane, rank: int, req: int, **fields) -> dict:
        return send(plane, rank, op="kv", do="claim", req=req, key=KEY, first=0, ticketed=0, num=NUM, **fields)

    for rank in range(3):
        first.on_connect(rank, {"op": "hello", "rank": rank})
        send(first, rank, op="join", config=config, pid=100 + rank, host="elsewhere")
    kv_claim(first, 0, 1)
    kv_claim(first, 2, 1)
    kv_claim(first, 0, 2)
    kv_claim(first, 1, 1, follow=[0, 0])
    kv_claim(first, 1, 2, follow=[0, 2])  # waits
    first.flush()
    second = JournaledPlane(ControlPlane())
    second.replay(read_journal(path, CREDENTIALS.launch)[1])
    assert second.plane.sessions[1].followed.waiting(KEY) == {1: (0, 2)}
    for plane in (first, second):  # the next messages get the same answers from both
        saved = dict(seq)
        released = kv_claim(plane, 0, 3)
        assert released[0][0]["value"] == released[1][0]["value"] and released[1][0]["req"] == 2
        assert kv_claim(plane, 1, 3, follow=[0, 1])[1][0]["value"] == [2, None]
        seq.update(saved)
    assert first.ring == second.ring


# -- a real plane ---------------------------------------------------------------------------------
@pytest.fixture()
def sessions():
    """Three ranks' sessions of one control plane (served from a thread)."""
    plane = ControlPlane()
    server = MessageServer(plane.handle, "127.0.0.1", CREDENTIALS, on_disconnect=plane.on_disconnect)
    server.start()
    clients = [ControlClient(*server.address, rank=r, timeout=10, credentials=CREDENTIALS) for r in range(3)]
    config = SessionConfig(3, make_policy("random", 3, 2).spec(), timeout=10)
    opened = [client.open_session(1, config) for client in clients]
    yield server, opened
    for session in opened:
        session.close()
    for client in clients:
        client.close()
    server.close()


def test_a_client_follows_its_leaders_claims_and_fails_fast_when_the_leader_leaves(sessions):
    _, (leader, follower, other) = sessions
    waiting = follower.counters.begin_claim(KEY, 4, "t", NUM, num=NUM, follow=(0, 0))
    assert waiting.park  # as long as a parked claim may wait (not the client's timeout)
    claimed = leader.counters.begin_claim(KEY, 4, "t", NUM, num=NUM).result()
    assert claimed == (4, 1) and waiting.result() == (4, 1)
    assert other.counters.begin_claim(KEY, 4, "t", NUM, num=NUM).result() == (5, 2)
    assert leader.counters.begin_claim(KEY, 4, "t", NUM, num=NUM).result() == (6, 3)
    assert follower.counters.begin_claim(KEY, 4, "t", NUM, num=NUM, follow=(0, 1)).result() == (6, 3)
    with pytest.raises(ControlPlaneError, match="cannot follow its own claims"):
        follower.counters.begin_claim(KEY, 4, num=NUM, follow=(1, 0)).result()
    waiting = follower.counters.begin_claim(KEY, 4, "t", NUM, num=NUM, follow=(0, 2))
    started = time.monotonic()
    leader.client.close()  # its process ends: it departs, and its follower learns it at once
    with pytest.raises(ControlPlaneError, match="rank 0, the leader of its replica, left the job"):
        waiting.result()
    assert time.monotonic() - started < 5
    # the others go on: the leader's chunks (4 and 6) go back to the queue, with their tickets
    assert other.counters.begin_claim(KEY, 4, "t", NUM, num=NUM).result() == (4, 1)


@pytest.mark.parametrize("bad", [[0], [0, 1, 2], "0,1", {"leader": 0, "n": 1}, [0, -1], [-1, 0], [0, 1.5],
                                 [True, 1], [0, "1"], [1 << 40, 0], None])  # fmt: skip
def test_a_follow_that_is_not_a_leaders_rank_and_a_count_is_a_bad_message(bad):
    message = {"op": "kv", "s": 1, "rank": 1, "req": 1, "do": "claim", "key": KEY, "first": 0, "ticketed": 0}
    with pytest.raises(BadMessage, match="follow"):
        decode_message(json.dumps({**message, "follow": bad}).encode())
    assert decode_message(json.dumps({**message, "follow": [0, 3]}).encode())["follow"] == [0, 3]


def test_a_hostile_follow_costs_its_sender_the_connection_and_the_session_goes_on(sessions):
    server, (leader, follower, other) = sessions
    link = MessageLink(*server.address, 7, timeout=10, credentials=CREDENTIALS)
    bad = {"op": "kv", "s": 1, "rank": 7, "req": 1, "do": "claim", "key": KEY, "first": 0, "ticketed": 0}
    link.send({**bad, "follow": [0, "x" * 100]})
    with pytest.raises(ControlPlaneError, match="refused a message of this rank: 'kv' claim: field 'follow'"):
        link.receive(timeout=10)
    link.close()
    assert server.alive and server.refused == 1
    # a follow the plane cannot do is answered to its sender, which goes on; nothing else changed
    with pytest.raises(ControlPlaneError, match="not a live member"):
        follower.counters.begin_claim(KEY, 4, num=NUM, follow=(7, 0)).result()
    assert leader.counters.begin_claim(KEY, 4, "t", NUM, num=NUM).result() == (4, 1)
    assert follower.counters.begin_claim(KEY, 4, "t", NUM, num=NUM, follow=(0, 0)).result() == (4, 1)
    assert other.counters.begin_claim(KEY, 4, "t", NUM, num=NUM).result() == (5, 2)


def test_requeued_work_is_not_touched_by_follows():
    session = session_of()
    session.values[KEY + REQUEUED] = [[3, 5]]  # a lost member's chunk 3, with its ticket
    out: dict = {}
    follow(session, 1, 0, out)
    assert session.values[KEY + REQUEUED] == [[3, 5]]
    claim(session, LEADER, 1, out)
    assert replies(out, FOLLOWER) == {1: [3, 5]} and session.values[KEY + REQUEUED] == []
