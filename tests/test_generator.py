"""The Group Generator and every policy are deadlock-free, in any interleaving, and cheap per request."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import assert_consistent_order, request_waves, simulate

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.policies import POLICY_NAMES, make_policy
from lightning_prague.core.plane.generator import GroupGenerator
from lightning_prague.core.protocol import STOP_SYNC


@st.composite
def setups(draw, policies=POLICY_NAMES):
    world = draw(st.integers(2, 16))
    group = draw(st.integers(2, world))
    per_node = draw(st.integers(1, world))
    policy = draw(st.sampled_from(policies))
    seed = draw(st.integers(0, 2**16))
    steps = draw(st.lists(st.integers(0, 12), min_size=world, max_size=world))
    return world, group, per_node, policy, seed, steps


@settings(max_examples=150, deadline=None)
@given(setups())
def test_every_policy_is_deadlock_free_and_consistent(setup):
    world, group, per_node, name, seed, steps = setup
    policy = make_policy(name, world, group, seed, workers_per_node=per_node)
    generator = GroupGenerator(world, policy)
    result = simulate(generator, dict(enumerate(steps)), random.Random(seed))
    assert result.released, "the final synchronization point was never released"
    assert_consistent_order(result)
    limit = group + 1 if name == "buffer" else group
    if name == "static":  # one inter-node group spans a column of all nodes
        limit = max(policy.workers_per_node, -(-world // policy.workers_per_node))
    for members in result.groups.values():
        assert 2 <= len(members) <= limit and list(members) == sorted(set(members))
    assert result.steps == dict(enumerate(steps)), "some worker did not finish its steps"


@settings(max_examples=60, deadline=None)
@given(setups(policies=("random", "buffer", "division")))
def test_slow_workers_do_not_deadlock_when_others_finish_first(setup):
    world, group, per_node, name, seed, steps = setup
    steps = [0] + [10] * (world - 1)  # rank 0 finishes at once and parks; the others keep asking
    generator = GroupGenerator(world, make_policy(name, world, group, seed, per_node))
    result = simulate(generator, dict(enumerate(steps)), random.Random(seed))
    assert result.released
    assert all(result.steps[r] == 10 for r in range(1, world)), "fast workers were held up by the parked one"


def test_parked_workers_are_not_given_new_groups():
    world = 4
    generator = GroupGenerator(world, make_policy("random", world, 3, seed=1))
    generator.handle({"op": "arrive", "rank": 0, "sync": "epoch_end"})
    for req in range(1, 50):
        out = generator.handle({"op": "ready", "rank": 1 + req % 3, "req": req})
        for items in out.values():
            for item in items:
                if item["t"] == "group":
                    assert 0 not in item["members"]


def test_generator_is_deterministic_for_a_seed():
    def run(seed):
        generator = GroupGenerator(8, make_policy("random", 8, 3, seed=seed))
        return [generator.handle({"op": "ready", "rank": i % 8, "req": i}) for i in range(40)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_mismatched_sync_points_give_an_error_naming_ranks():
    generator = GroupGenerator(3, make_policy("random", 3, 2))
    generator.handle({"op": "arrive", "rank": 0, "sync": "epoch_end@epoch1"})
    generator.handle({"op": "arrive", "rank": 1, "sync": "epoch_end@epoch1"})
    out = generator.handle({"op": "arrive", "rank": 2, "sync": "fit_end"})
    message = out[2][0]["message"]
    assert out[2][0]["t"] == "error"
    assert "ranks [0, 1] at 'epoch_end@epoch1'" in message and "ranks [2] at 'fit_end'" in message


def test_stop_releases_everyone_only_after_all_arrive_at_the_stop_point():
    generator = GroupGenerator(3, make_policy("random", 3, 2))
    generator.handle({"op": "arrive", "rank": 0, "sync": "epoch_end"})
    out = generator.handle({"op": "stop", "rank": 1})
    assert all(out[r] == [{"t": "stop", "reason": "sigterm"}] for r in range(3))
    # rank 0 was parked at epoch_end: no release for it until everyone arrives at the stop point
    assert not generator.handle({"op": "arrive", "rank": 1, "sync": STOP_SYNC})
    assert not generator.handle({"op": "arrive", "rank": 2, "sync": STOP_SYNC})
    out = generator.handle({"op": "arrive", "rank": 0, "sync": STOP_SYNC})
    release = {
        "t": "release",
        "sync": STOP_SYNC,
        "version": 0,
        "stop": True,
        "requeue": False,
        "speeds": [0.0] * 3,
        "pending": [],
        "members": [0, 1, 2],
        "leader": 0,
        "complete": True,
    }
    assert all(out[r] == [release] for r in range(3))
    # requests after a stop are answered without a group
    out = generator.handle({"op": "ready", "rank": 2, "req": 7})
    assert out == {2: [{"t": "answer", "req": 7, "gid": None}]}


def test_random_groups_are_uniform_distinct_and_exclude_lagging_workers():
    world = 64
    generator = GroupGenerator(world, make_policy("random", world, 4, seed=2))
    for _ in range(40):  # every worker but 5 reports 40 times: 5 is far behind
        for r in range(world):
            if r != 5:
                generator.handle({"op": "ready", "rank": r, "req": 1})
    assert 5 in generator.lagging()
    seen = set()
    for req in range(400):
        out = generator.handle({"op": "ready", "rank": 9, "req": 100 + req})
        (group,) = [item for item in out[9] if item["t"] == "group"]
        members = group["members"]
        assert len(members) == 4 == len(set(members)) and 9 in members and members == sorted(members)
        assert 5 not in members, "a lagging worker was drawn into a fast worker's group"
        seen.update(members)
    assert seen == set(range(world)) - {5}, "some worker was never drawn"


def test_first_ready_groups_only_ready_workers_in_arrival_order():
    generator = GroupGenerator(6, make_policy("first_ready", 6, 3))
    assert generator.handle({"op": "ready", "rank": 4, "req": 1}) == {}
    assert generator.handle({"op": "ready", "rank": 1, "req": 1}) == {}
    out = generator.handle({"op": "ready", "rank": 5, "req": 1})
    group = out[4][0]
    assert group["t"] == "group" and group["members"] == [1, 4, 5]
    assert set(out) == {1, 4, 5}
    # when everybody else is parked, a lone ready worker is answered without a group
    for r in (0, 2, 3, 4, 5):
        generator.handle({"op": "arrive", "rank": r, "sync": "end"})
    out = generator.handle({"op": "ready", "rank": 1, "req": 2})
    assert out == {1: [{"t": "answer", "req": 2, "gid": None}]}


@pytest.mark.parametrize(
    ("name", "world", "group", "match"),
    [
        ("random", 4, 5, "group_size=5 is invalid for 4 workers"),
        ("random", 4, 1, "group_size=1 is invalid"),
        ("rnd", 4, 2, "grouping='rnd' is not a known grouping policy"),
        ("random", 1, 2, "at least 2 workers"),
    ],
)
def test_bad_policy_configuration_names_the_option(name, world, group, match):
    with pytest.raises(ConfigurationError, match=match):
        make_policy(name, world, group)


def test_lagging_workers_are_left_out_of_other_workers_groups_but_mix_through_their_own():
    world = 6
    generator = GroupGenerator(world, make_policy("random", world, 3, seed=0))
    req = 0
    for _ in range(10):  # ranks 1..5 take ten steps while rank 0 takes none
        for r in range(1, world):
            req += 1
            generator.handle({"op": "ready", "rank": r, "req": req})
    assert generator.lagging() == {0}
    for _ in range(20):
        for r in range(1, world):
            req += 1
            out = generator.handle({"op": "ready", "rank": r, "req": req})
            assert 0 not in out, "a fast worker was grouped with the lagging one"
    out = generator.handle({"op": "ready", "rank": 0, "req": 1})
    assert out[0][0]["t"] == "group" and 0 in out[0][0]["members"], "the lagging worker must still get a group"
    slow_free = GroupGenerator(world, make_policy("random", world, 3, seed=0), avoid_stragglers=False)
    for r in range(1, world):
        for step in range(10):
            slow_free.handle({"op": "ready", "rank": r, "req": step})
    assert slow_free.lagging() == set()


def test_a_leaving_worker_is_withdrawn_and_the_others_go_on_without_it():
    generator = GroupGenerator(3, make_policy("first_ready", 3, 2))
    generator.handle({"op": "ready", "rank": 1, "req": 4, "version": 0})
    out = generator.handle({"op": "leave", "rank": 1})
    # its pending request is answered without a group, then it is told it left
    assert out[1] == [{"t": "answer", "req": 4, "gid": None}, {"t": "left"}]
    # it is never grouped again: the others pair up with each other
    generator.handle({"op": "ready", "rank": 0, "req": 1, "version": 0})
    out = generator.handle({"op": "ready", "rank": 2, "req": 1, "version": 0})
    assert out[0][0]["members"] == [0, 2] and 1 not in out
    # the next synchronization point waits for the live workers only, and names them
    generator.handle({"op": "arrive", "rank": 0, "sync": "epoch_end@epoch0"})
    out = generator.handle({"op": "arrive", "rank": 2, "sync": "epoch_end@epoch0"})
    assert out[0][0]["t"] == "release" and out[0][0]["members"] == [0, 2] and 1 not in out
    # a message that still comes from it changes nothing (a request gets no group)
    assert generator.handle({"op": "ready", "rank": 1, "req": 5, "version": 0}) == {
        1: [{"t": "answer", "req": 5, "gid": None}]
    }


def test_a_commit_meeting_says_complete_only_if_no_live_rank_reported_an_incomplete_sum():
    generator = GroupGenerator(3, make_policy("random", 3, 2))
    generator.handle({"op": "arrive", "rank": 0, "sync": "end/commit"})
    generator.handle({"op": "arrive", "rank": 1, "sync": "end/commit", "incomplete": True})
    out = generator.handle({"op": "arrive", "rank": 2, "sync": "end/commit"})
    assert [out[r][0]["complete"] for r in range(3)] == [False] * 3  # one decision for every rank
    # the next meeting starts afresh; an incomplete report of a rank that then departs does not count
    generator.handle({"op": "arrive", "rank": 1, "sync": "again/commit", "incomplete": True})
    generator.handle({"op": "arrive", "rank": 0, "sync": "again/commit"})
    out = {}
    generator.depart(1, out)
    assert out == {}  # rank 2 has not arrived yet
    out = generator.handle({"op": "arrive", "rank": 2, "sync": "again/commit"})
    assert out[0][0]["complete"] is True and out[0][0]["members"] == [0, 2]
    # a stop does not hold a commit meeting back (the ranks run to the stop point after it)
    generator.handle({"op": "stop", "rank": 0})
    generator.handle({"op": "arrive", "rank": 0, "sync": "again/commit"})
    out = generator.handle({"op": "arrive", "rank": 2, "sync": "again/commit"})
    assert [item["t"] for item in out[0]] == ["release"] and out[0][0]["stop"] is True


def test_a_departure_releases_a_meeting_that_waited_for_it_and_below_min_workers_the_job_stops():
    generator = GroupGenerator(3, make_policy("random", 3, 2), min_workers=2)
    generator.handle({"op": "arrive", "rank": 0, "sync": "epoch_end@epoch0"})
    generator.handle({"op": "arrive", "rank": 2, "sync": "epoch_end@epoch0"})
    out: dict = {}
    generator.depart(1, out)  # kill -9 of the last rank the meeting waited for
    assert [item["t"] for item in out[0]] == ["release"] and out[0][0]["members"] == [0, 2]
    assert out[0][0]["stop"] is False
    out = {}
    generator.depart(2, out)  # one worker left, fewer than min_workers: the job stops
    assert out[0] == [{"t": "stop", "reason": "request"}]


@pytest.mark.parametrize("sigma, slow", [(0.0, {}), (0.3, {}), (0.3, {5: 5.0})])
def test_group_buffer_hands_out_disjoint_groups_where_random_groups_conflict(sigma, slow):
    world, group = 16, 4

    def waves(name: str):
        generator = GroupGenerator(world, make_policy(name, world, group, seed=7))
        return request_waves(generator, 60, random.Random(1), sigma=sigma, slow=slow)

    buffer, random_groups = waves("buffer"), waves("random")
    assert random_groups.conflicting_fraction() > 0.9
    # the brief's Group Buffer: a worker is handed the buffered group that already contains it, so
    # the groups of one wave are disjoint (a lagging straggler's own groups aside: its round's
    # partners have moved on, and each of its requests adds one group that overlaps theirs)
    assert buffer.conflicting_fraction(excluding=set(slow)) == 0.0
    assert buffer.conflicting_fraction() <= random_groups.conflicting_fraction() / (3 if not slow else 2)
    # and a worker that keeps pace averages about once per step, not once per member of each group
    fast = [r for r in range(world) if r not in slow]
    assert buffer.groups_per_request(fast) < 1.2 < group - 0.5 < random_groups.groups_per_request(fast)


def test_a_gossip_phase_ends_in_the_meeting_at_one_final_round():
    generator = GroupGenerator(3, make_policy("random", 3, 2))
    # everyone stopped at the same round and nobody went idle: the phase ends there
    for rank in range(2):
        assert not generator.handle({"op": "arrive", "rank": rank, "sync": "e0", "round": 5})
    out = generator.handle({"op": "arrive", "rank": 2, "sync": "e0", "round": 5})
    assert {item["final"] for items in out.values() for item in items} == {5}
    # uneven: rank 0 waits, asks for idle rounds (waiting ranks are told at once, later ones on arrival)
    generator.handle({"op": "arrive", "rank": 0, "sync": "e1", "round": 7})
    assert generator.handle({"op": "idle", "rank": 0}) == {0: [{"t": "idle"}]}
    assert generator.handle({"op": "idle", "rank": 0}) == {}  # once per meeting
    assert generator.handle({"op": "arrive", "rank": 1, "sync": "e1", "round": 9}) == {1: [{"t": "idle"}]}
    out = generator.handle({"op": "arrive", "rank": 2, "sync": "e1", "round": 11})
    # ranks that served idle rounds are past the rounds they reported: the final round is settled
    releases = [item for items in out.values() for item in items if item["t"] == "release"]
    assert len(releases) == 3 and all(r["settle"] and "final" not in r for r in releases)
    # each reports the rounds it has issued, and the largest is final; a rank lost meanwhile is not waited for
    assert not generator.handle({"op": "arrive", "rank": 0, "sync": "e1/rounds", "round": 16, "settle": True})
    assert not generator.handle({"op": "arrive", "rank": 2, "sync": "e1/rounds", "round": 11, "settle": True})
    out: dict = {}
    generator.depart(1, out)
    assert {r: [item["final"] for item in items] for r, items in out.items()} == {0: [16], 2: [16]}
    assert out[0][0]["members"] == [0, 2] and "settle" not in out[0][0]


def test_a_requeue_stop_is_announced_even_after_a_sigterm_stop_and_its_release_says_so():
    generator = GroupGenerator(2, make_policy("random", 2, 2))
    out = generator.handle({"op": "stop", "rank": 0, "reason": "sigterm"})
    assert out == {r: [{"t": "stop", "reason": "sigterm"}] for r in range(2)}
    # the cluster's requeue signal asks for more than a stop: every rank hears of it
    out = generator.handle({"op": "stop", "rank": 1, "reason": "requeue"})
    assert out == {r: [{"t": "stop", "reason": "requeue"}] for r in range(2)}
    assert generator.handle({"op": "stop", "rank": 0, "reason": "sigterm"}) == {}  # nothing new
    generator.handle({"op": "arrive", "rank": 0, "sync": STOP_SYNC})
    out = generator.handle({"op": "arrive", "rank": 1, "sync": STOP_SYNC})
    assert all(items[0]["requeue"] and items[0]["stop"] for items in out.values())


def test_with_avoid_busy_groups_draw_only_workers_that_finished_their_last_group():
    world = 4
    generator = GroupGenerator(world, make_policy("random", world, 3, seed=0), avoid_busy=True)
    out = generator.handle({"op": "ready", "rank": 3, "req": 1})  # rank 3 (a slow link, say) asks first
    first = tuple(out[3][0]["members"])
    assert len(first) == 3 and generator.busy == set(first)
    idle = [r for r in range(world) if r not in first]
    # the one idle worker finds nobody idle to average with: no group, rather than a wait behind rank 3's
    out = generator.handle({"op": "ready", "rank": idle[0], "req": 1})
    assert out == {idle[0]: [{"t": "answer", "req": 1, "gid": None}]}
    # a member of it asks: it runs that group now (it was issued before this answer) and gets no other
    other = next(r for r in first if r != 3)
    out = generator.handle({"op": "ready", "rank": other, "req": 1})
    assert out == {other: [{"t": "answer", "req": 1, "gid": None}]} and generator.is_busy(other)
    # when it asks again it has finished that group: it is idle, and so a group of two forms
    out = generator.handle({"op": "ready", "rank": other, "req": 2})
    assert sorted(out[other][0]["members"]) == sorted([other, idle[0]])
    assert generator.is_busy(3) and generator.is_busy(idle[0])
    # a synchronization point's release: everyone has drained, nobody is busy
    for r in range(world):
        generator.handle({"op": "arrive", "rank": r, "sync": "epoch_end"})
    assert generator.busy == set()
    # without avoid_busy (the paper's Group Generator) busy workers are drawn as before
    plain = GroupGenerator(world, make_policy("random", world, 3, seed=0))
    plain.handle({"op": "ready", "rank": 3, "req": 1})
    out = plain.handle({"op": "ready", "rank": idle[0], "req": 1})
    assert len(out[idle[0]][0]["members"]) == 3 and plain.busy == set()


@settings(max_examples=40, deadline=None)
@given(setups(policies=("random", "division")))
def test_avoiding_busy_workers_stays_deadlock_free(setup):
    world, group, per_node, name, seed, steps = setup
    generator = GroupGenerator(world, make_policy(name, world, group, seed, per_node), avoid_busy=True)
    result = simulate(generator, dict(enumerate(steps)), random.Random(seed))
    assert result.released
    assert_consistent_order(result)
    assert result.steps == dict(enumerate(steps))


def test_with_avoid_busy_a_lagging_worker_averages_in_pairs():
    world = 6
    generator = GroupGenerator(world, make_policy("random", world, 3, seed=0), avoid_busy=True)
    req = 0
    for _ in range(10):  # ranks 1..5 ask ten times (each finishing its group first) while rank 0 asks none
        for r in range(1, world):
            req += 1
            generator.handle({"op": "ready", "rank": r, "req": req})
            generator.busy.clear()  # as if every group had finished at once
            generator._waiting.clear()
    assert generator.lagging() == {0}
    out = generator.handle({"op": "ready", "rank": 0, "req": 1})
    group = out[0][0]
    assert group["t"] == "group" and len(group["members"]) == 2 and 0 in group["members"]
