"""A claim at an emptied work queue waits while a live member may still give chunks back.

The control plane's side, driven message by message (`CoordinatorSession`, `QueueEnds`); the
whole path, with real processes and kill -9 and hangs, is in `test_exactly_once.py`.
"""

from __future__ import annotations

import pytest

from lightning_prague.core.grouping.policies import make_policy
from lightning_prague.core.plane.coordinator import CoordinatorSession
from lightning_prague.core.plane.queue_end import MAX_PARKED_PER_RANK, MAX_QUEUES, QueueEnds
from lightning_prague.core.protocol import SessionConfig

KEY = "epoch/0/cursor"
NUM = 6  # chunks 0-2 are set aside for ranks 0-2, the queue hands out 3-5


def session_of(world: int = 3) -> CoordinatorSession:
    session = CoordinatorSession(1, SessionConfig(world, make_policy("random", world, 2).spec()))
    session.members.update(range(world))
    return session


def claim(
    session: CoordinatorSession, rank: int, req: int, out: dict, first_claim: bool = False, reports: bool = False
) -> None:
    message = {"do": "claim", "key": KEY, "first": 3, "ticketed": 0, "num": NUM, "park": True}
    if reports:  # it trains (and reports) what it holds while the claim waits
        message["reports"] = True
    if first_claim:
        message.update(members=[0, 1, 2], preset=[0, 1, 2])
    session.kv(rank, req, message, out)


def queue_handed_out(session: CoordinatorSession) -> dict:
    """Every rank claimed once: the queue's three chunks are out; returns an empty `out`."""
    out: dict = {}
    claim(session, 0, 1, out, first_claim=True)
    claim(session, 1, 1, out)
    claim(session, 2, 1, out)
    return {}


def replies(out: dict) -> dict[int, list]:
    """rank -> the value of the reply it got (each rank has at most one claim in flight here)."""
    return {rank: item["value"] for rank, items in out.items() for item in items if item["t"] == "reply"}


def test_a_claim_at_the_end_waits_for_a_member_still_training_and_gets_what_it_gives_back():
    session = session_of()
    out: dict = {}
    claim(session, 0, 1, out, first_claim=True)
    claim(session, 1, 1, out)
    claim(session, 0, 2, out)
    assert replies(out) == {0: [5, None], 1: [4, None]}  # 0 got 3 first, then 5
    out = {}
    claim(session, 0, 3, out)  # the queue is empty; rank 2 still trains its set-aside chunk 2
    assert replies(out) == {}
    session.report_work(1, {"key": KEY, "done": [1]})
    claim(session, 1, 2, out)
    assert replies(out) == {}  # both wait for rank 2
    session.depart(2, "killed", out)  # chunk 2 goes back, with its set-aside ticket: to the first that waited
    assert replies(out) == {0: [2, 0]}
    out = {}  # rank 1 now waits for rank 0, which may be lost with chunk 2 in hand
    session.report_work(0, {"key": KEY, "done": [0, 3, 5, 2]})
    assert replies(out) == {}
    claim(session, 0, 4, out)  # rank 0 trained it and comes back: nobody is left to wait for
    assert {rank: value[0] >= NUM for rank, value in replies(out).items()} == {0: True, 1: True}
    assert session.work.lose(0) == {} and session.work.lose(1) == {KEY: [(4, None)]}


def test_every_waiting_claim_returns_empty_once_no_member_is_left_to_wait_for():
    session = session_of()
    out = queue_handed_out(session)
    claim(session, 0, 2, out)
    claim(session, 1, 2, out)
    assert replies(out) == {}
    claim(session, 2, 2, out)  # the last member comes to the end: nobody can give chunks back
    assert set(replies(out)) == {0, 1, 2} and all(value[0] >= NUM for value in replies(out).values())


def test_a_member_at_a_meeting_or_done_claiming_or_closed_is_not_waited_for():
    for release in ("arrive", "end", "close"):
        session = session_of()
        out = queue_handed_out(session)
        claim(session, 0, 2, out)
        claim(session, 1, 2, out)
        assert replies(out) == {}, release
        if release == "arrive":  # it waits at a boundary: the parked claims must not wait for it
            session.generator.handle({"op": "arrive", "rank": 2, "sync": "progress@5"})
            session.settle_queues(out)
        elif release == "end":  # it left the epoch's tail: waited for until it trained what it holds
            session.report_work(2, {"key": KEY, "end": True})
            session.settle_queues(out)
            assert replies(out) == {}
            session.report_work(2, {"key": KEY, "done": [2, 5]})
            session.settle_queues(out)
        else:
            session.members.discard(2)
            session.settle_queues(out)
        assert set(replies(out)) == {0, 1}, release


def test_a_claim_that_reports_keeps_the_others_waiting_until_its_rank_trained_what_it_holds():
    """A rank sends its next claim while it trains the chunk before: at the queue's end that claim parks
    while the chunk is in training. A claim that `reports` (its rank takes the answer only after its
    step) keeps the parked claims waiting for that chunk: a rank lost in its last step gives it to them.
    A claim that does not (its rank fetches ahead) is not waited for once parked, as before."""
    for lost in (False, True):
        session = session_of()
        out = queue_handed_out(session)  # rank 0 holds 0 and 3, rank 1 holds 1 and 4, rank 2 holds 2 and 5
        session.report_work(1, {"key": KEY, "done": [1, 4]})
        session.report_work(2, {"key": KEY, "done": [2]})
        session.report_work(0, {"key": KEY, "done": [0]})
        claim(session, 0, 2, out, reports=True)  # trains 3 meanwhile
        claim(session, 1, 2, out)
        claim(session, 2, 2, out, reports=True)  # trains 5 meanwhile
        assert replies(out) == {}, "every claim waits for the chunks in training"
        session.report_work(2, {"key": KEY, "done": [5]})
        session.settle_queues(out)
        assert replies(out) == {}, "rank 0 still trains chunk 3"
        if lost:  # rank 0 is lost in its last step: a waiting claim trains its chunk
            session.depart(0, "killed", out)
            assert replies(out) == {1: [3, None]}
            out = {}
            session.report_work(1, {"key": KEY, "done": [3]})
            claim(session, 1, 3, out, reports=True)
        else:
            session.report_work(0, {"key": KEY, "done": [3]})
            session.settle_queues(out)
        ended = replies(out)
        assert set(ended) == ({1, 2} if lost else {0, 1, 2}) and all(v[0] >= NUM for v in ended.values()), ended
    # without `reports`, a parked claim's own rank is not waited for: all end while chunk 3 is in training
    session = session_of()
    out = queue_handed_out(session)
    session.report_work(1, {"key": KEY, "done": [1, 4]})
    session.report_work(2, {"key": KEY, "done": [2, 5]})
    session.report_work(0, {"key": KEY, "done": [0]})
    for rank in (0, 1, 2):
        claim(session, rank, 2, out)
    assert set(replies(out)) == {0, 1, 2}


def test_deleting_the_queue_answers_its_waiting_claims_and_a_rank_waits_once_per_queue():
    session = session_of()
    out = queue_handed_out(session)
    claim(session, 1, 2, out)
    with pytest.raises(ValueError, match="already waits"):
        claim(session, 1, 3, out)
    session.kv(2, 7, {"do": "delete", "key": KEY}, out)
    assert 1 in replies(out) and replies(out)[1][0] >= NUM


def test_a_rank_that_claims_on_the_next_epoch_is_done_with_this_one():
    session = session_of()
    out = queue_handed_out(session)
    claim(session, 1, 2, out)
    claim(session, 0, 2, out)
    assert replies(out) == {}
    session.report_work(2, {"key": KEY, "done": [2, 5]})
    session.kv(2, 3, {"do": "claim", "key": "epoch/1/cursor", "first": 3, "ticketed": 0, "num": NUM}, out)
    assert {0, 1} <= set(replies(out))


def test_what_a_rank_sends_about_queue_ends_is_bounded_and_costs_no_other_rank_its_claims():
    ends = QueueEnds()
    for index in range(10 * MAX_QUEUES):  # a rank says it is done on ever new queues: they push each other out
        ends.finish(f"junk{index}", 9)
    ends.park(KEY, 0, 1, 10)  # a real claim at a real queue's end still waits
    assert ends.parked(KEY) == [0]
    for index in range(MAX_PARKED_PER_RANK):
        ends.park(f"q{index}", 9, index, 10)
    with pytest.raises(ValueError, match="claims of"):
        ends.park("one more", 9, 99, 10)
    for index in range(MAX_QUEUES):  # the queues with waiting claims are kept; room is made from the others
        ends.finish(f"more{index}", 9)
    assert ends.parked(KEY) == [0]


def test_a_rank_that_left_the_tail_and_is_lost_gives_its_chunks_to_the_waiting_claims():
    session = session_of()
    out: dict = {}
    claim(session, 0, 1, out, first_claim=True)
    claim(session, 1, 1, out)
    session.report_work(2, {"key": KEY, "end": True})  # slow: it leaves chunk 5 to the others
    out = {}
    claim(session, 0, 2, out)
    claim(session, 1, 2, out)
    assert replies(out) == {0: [5, None]}  # the queue's last chunk
    out = {}
    session.report_work(0, {"key": KEY, "done": [0, 3]})
    claim(session, 0, 3, out)
    assert replies(out) == {}  # rank 2 still trains its set-aside chunk 2
    session.depart(2, "hung", out)
    assert replies(out) == {1: [2, 0]}


def test_a_meeting_names_what_lost_ranks_gave_back_and_nobody_claimed_again_for_its_checkpoint():
    """A checkpoint taken at a meeting holds every chunk not trained yet: the ranks' own (`pending`) and
    what a lost rank gave back that is still in the queue (`requeued`), so a fit resumed from it trains
    those too; once a rank claimed them again they are its own."""
    session = session_of()
    out = queue_handed_out(session)  # rank 2 holds its set-aside chunk 2 and chunk 5
    session.depart(2, "killed", out)
    releases = []
    for rank in (0, 1):
        items = session.generator.handle({"op": "arrive", "rank": rank, "sync": "progress@4", "untrained": [rank]})
        releases += [item for items in items.values() for item in items if item["t"] == "release"]
    assert len(releases) == 2 and all(r["requeued"] == [[2, 0], [5, None]] for r in releases), releases
    assert releases[0]["pending"] == [0, 1]
    out = {}
    claim(session, 0, 2, out)  # taken back by rank 0: no longer in the queue
    claim(session, 1, 2, out)
    assert sorted(value[0] for value in replies(out).values()) == [2, 5]
    assert session.requeued_work() == []


def test_a_checkpoint_at_that_meeting_resumes_the_given_back_work_too():
    """The rank's side: the loader's checkpoint state takes the release's `requeued` work with its own,
    as chunks (map-style) or as shards with the positions they were trained to (a sharded stream)."""
    from lightning_prague.core.data.progress import ProgressCounter
    from lightning_prague.core.data.progress_loader import ProgressLoader

    loader = ProgressLoader([], ProgressCounter(store=None, timeout=1.0), lambda: 0)
    loader.untrained_at_meeting({"pending": [7, 1], "positions": [[3, 40]], "requeued": [[5, None], [2, 16]]})
    assert loader.pending == [1, 2, 5, 7]
    assert loader.positions == [[2, 16], [3, 40], [5, 0]]
    loader.untrained_at_meeting({"pending": [1]})  # (nothing given back)
    assert loader.pending == [1] and loader.positions == []


def test_a_rank_gives_back_only_what_it_holds_and_a_waiting_claim_gets_it_from_its_position():
    """A slow rank's shard given back from a position goes to a claim waiting at the queue's end, with that
    position (where its reader goes on); a `back` naming a chunk the sender does not hold requeues nothing."""
    session = session_of()
    out = queue_handed_out(session)  # rank 0 holds its set-aside 0 and chunk 3, rank 1: 1 and 4, rank 2: 2 and 5
    session.report_work(1, {"key": KEY, "done": [1, 4]})
    claim(session, 1, 2, out)  # at the queue's end: it waits for ranks 0 and 2
    assert replies(out) == {}
    session.report_work(2, {"key": KEY, "back": [[0, 40], [3, 8]]})  # not rank 2's: nothing happens
    session.settle_queues(out)
    assert replies(out) == {} and session.requeued_work() == []
    session.report_work(0, {"key": KEY, "back": [[3, 8]], "end": True})
    session.settle_queues(out)
    assert replies(out) == {1: [3, 8]}  # rank 1 reads chunk 3 on from position 8, and holds it
    assert session.work.lose(1) == {KEY: [(3, 8)]}


def test_a_shard_given_back_goes_to_a_parked_claim_and_is_refused_once_nobody_claims():
    """A slow rank's give-back (`give_back`, a sharded stream's tail) is taken while a claim is parked, and
    refused once the parked claims were released and their ranks ended their epoch (a member at a meeting
    releases them): nobody would claim the shard again, so its holder keeps it."""
    session = session_of()
    out = queue_handed_out(session)
    claim(session, 1, 2, out)  # ranks 1 and 2 wait at the queue's end; rank 0 reads chunk 5 (a shard)
    claim(session, 2, 2, out)
    session.report_work(0, {"key": KEY, "hold": [5], "tickets": [8]})
    session.kv(0, 5, {"do": "give_back", "key": KEY, "shard": 5, "position": 8}, out)
    assert replies(out) == {0: True, 1: [5, 8]}  # taken: rank 1 reads it on from 8
    out = {}
    session.report_work(1, {"key": KEY, "done": [5]})
    claim(session, 1, 3, out)  # it waits at the queue's end again, for rank 0 (it holds its chunk 0)
    assert replies(out) == {}
    session.generator.parked[0] = "step"  # rank 0 at a meeting: the parked claims return empty
    session.settle_queues(out)
    assert sorted(replies(out)) == [1, 2] and all(chunk >= NUM for chunk, _ in replies(out).values())
    session.generator.parked.pop(0)
    out = {}
    session.kv(0, 6, {"do": "give_back", "key": KEY, "shard": 0, "position": 4}, out)
    assert replies(out) == {0: False}  # nobody would read it: rank 0 keeps it
    assert 0 in session.work.holders(KEY)
    out = {}
    session.kv(0, 7, {"do": "give_back", "key": KEY, "shard": 4, "position": 0}, out)
    assert replies(out) == {0: False}  # (a shard it does not hold: nothing to give)


def standby(session: CoordinatorSession, rank: int, req: int, out: dict) -> None:
    """`rank` left the epoch's tail: it stands by in a parked claim (`WorkQueueSampler`)."""
    message = {"do": "claim", "key": KEY, "first": 3, "ticketed": 0, "num": NUM, "park": True, "standby": True}
    session.kv(rank, req, message, out)


def test_a_rank_that_left_the_tail_takes_the_rest_when_the_ranks_that_took_it_are_lost():
    """Ranks 0 and 1 leave the tail and stand by; rank 2, the last claimer, is lost with chunk 2 in hand
    and chunks 4 and 5 never claimed. Nobody else would train them: rank 0 (standing by first) gets
    the given-back chunk and claims on, rank 1 standing by while rank 0 claims; the queue ends only
    once all is taken, every chunk claimed exactly once (found in CI: two survivors had left the
    tail, the three claimers were killed, and 862 of 1438 samples went untrained)."""
    session = session_of()
    out: dict = {}
    claim(session, 0, 1, out, first_claim=True)  # chunk 3
    session.report_work(0, {"key": KEY, "done": [0, 3]})
    session.report_work(1, {"key": KEY, "done": [1]})
    standby(session, 0, 2, out)
    standby(session, 1, 1, out)
    assert replies(out) == {0: [3, None]}, "rank 2 still claims: both stand by"
    out = {}
    session.depart(2, "killed", out)  # chunk 2 (set aside, ticket 0) back; chunks 4 and 5 never claimed
    assert replies(out) == {0: [2, 0]}, "rank 1 stands by while rank 0 claims"
    out = {}
    claim(session, 0, 3, out)
    claim(session, 0, 4, out)
    answered = replies(out)
    assert answered[0] == [5, None], "rank 0 took the queue's last two chunks (4, then 5)"
    assert answered[1][0] >= NUM, "the queue handed out every chunk: rank 1, standing by, ends its epoch"
    session.report_work(0, {"key": KEY, "done": [2, 4, 5]})
    out = {}
    standby(session, 0, 5, out)  # standing by again, the queue empty: its claim ends the epoch at once
    assert {rank: value[0] >= NUM for rank, value in replies(out).items()} == {0: True}


def test_a_rank_standing_by_ends_its_epoch_at_once_when_the_queue_handed_out_everything():
    session = session_of()
    out = queue_handed_out(session)  # chunks 3, 4, 5 out
    session.report_work(2, {"key": KEY, "done": [2, 5]})
    standby(session, 2, 2, out)
    # every chunk is handed out: nothing is left for rank 2 to take, and it need not wait for the others to
    # finish (Lightning fetched its last batch and waits for this claim before training it)
    assert {rank: value[0] >= NUM for rank, value in replies(out).items()} == {2: True}
    out = {}
    session.report_work(0, {"key": KEY, "done": [0, 3]})
    session.report_work(1, {"key": KEY, "done": [1, 4]})
    claim(session, 0, 2, out)
    claim(session, 1, 2, out)  # the queue is empty and nobody is lost: every claim ends the epoch
    assert set(replies(out)) == {0, 1} and all(value[0] >= NUM for value in replies(out).values())


def test_a_rank_standing_by_takes_nothing_while_the_others_meet_inside_the_epoch():
    """The others at a meeting inside the epoch (a validation at a global step) will claim on after it,
    and that meeting waits for the rank standing by: it ends its epoch, as a rank leaving the tail did,
    rather than take their chunks (found in CI: a 5x slower rank trained as many batches as the others)."""
    session = session_of()
    out: dict = {}
    claim(session, 0, 1, out, first_claim=True)  # chunk 3; chunks 4 and 5 are still in the queue
    session.report_work(2, {"key": KEY, "done": [2]})
    standby(session, 2, 1, out)
    assert replies(out) == {0: [3, None]}
    session.generator.parked.update({0: "val@7", 1: "val@7"})  # ranks 0 and 1 wait at a synchronization point
    out = {}
    session.settle_queues(out)
    assert replies(out) == {2: [NUM, None]} and 2 in session.ends._queues[KEY].done
