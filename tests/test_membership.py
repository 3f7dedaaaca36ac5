"""What every policy and topology becomes without the workers that left: groups among the live ones,
mixing that stays doubly stochastic, and a lost worker's untrained chunks back in the work queue."""

from __future__ import annotations

import random
import types
from datetime import timedelta

import pytest
import torch
from helpers import CREDENTIALS, run_core_ranks

from lightning_prague.core.client.control import Session
from lightning_prague.core.errors import CoordinationTimeout, MemberLost
from lightning_prague.core.exchange.gossip import surviving
from lightning_prague.core.grouping.bipartite import BipartiteGraph
from lightning_prague.core.grouping.policies import POLICY_NAMES, GossipPolicy, make_policy
from lightning_prague.core.grouping.topology import TOPOLOGIES, is_doubly_stochastic, make_topology
from lightning_prague.core.membership import RendezvousStore
from lightning_prague.core.plane.coordinator import CoordinatorSession
from lightning_prague.core.plane.generator import GroupGenerator
from lightning_prague.core.protocol import SessionConfig

WORLD = 8
LOST = (2, 5)


def groups_after_losses(generator: GroupGenerator, requests: int = 400, seed: int = 0) -> list[list[int]]:
    out: dict = {}
    for rank in LOST:
        generator.depart(rank, out)
    rng = random.Random(seed)
    live = [r for r in range(WORLD) if r not in LOST]
    issued = []
    for req in range(requests):
        rank = rng.choice(live)
        for items in generator.handle({"op": "ready", "rank": rank, "req": req, "version": 0}).values():
            issued += [item["members"] for item in items if item["t"] == "group"]
    return issued


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_policy_groups_a_lost_worker_again(name):
    generator = GroupGenerator(WORLD, make_policy(name, WORLD, 3, seed=1, workers_per_node=4))
    issued = groups_after_losses(generator)
    assert issued, "the survivors still form groups"
    assert all(len(members) >= 2 and not set(members) & set(LOST) for members in issued)


def test_adpsgd_pairs_stay_active_passive_pairs_of_live_neighbours():
    graph = BipartiteGraph.ring(WORLD)
    generator = GroupGenerator(WORLD, GossipPolicy(graph, seed=1))
    issued = groups_after_losses(generator)
    assert issued
    for a, b in issued:
        assert b in graph.neighbors[a] and graph.is_active(a) != graph.is_active(b)
        assert not {a, b} & set(LOST)
    # every live passive worker still has a live active neighbour: nobody is cut off
    paired = {r for pair in issued for r in pair}
    assert paired == set(range(WORLD)) - set(LOST)


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_every_topology_keeps_doubly_stochastic_rounds_without_the_lost_workers(name):
    schedule = make_topology(name, WORLD, workers_per_node=4)
    live = [r for r in range(WORLD) if r not in LOST]
    for round_index in range(schedule.period):
        seen = {}
        for rank in live:
            group = surviving(schedule.group_of(rank, round_index), live)
            assert rank in group.members and not set(group.members) & set(LOST)
            seen[group.members] = group
        w = torch.zeros(len(live), len(live), dtype=torch.float64)
        index = {r: i for i, r in enumerate(live)}
        for group in seen.values():
            for i in group.members:
                for j in group.members:
                    w[index[i], index[j]] = group.self_weight if i == j else group.peer_weight
        assert is_doubly_stochastic(w), (name, round_index, w)
        assert torch.allclose(w, w.T)


def claim(session: CoordinatorSession, rank: int, held: list[int], ticketed: int = 100) -> tuple[int, int | None]:
    out: dict = {}
    message = {"do": "claim", "key": "epoch/0/cursor", "first": 4, "tickets": "progress/0/claims",
               "ticketed": ticketed, "held": held, "num": 20}  # fmt: skip
    session.kv(rank, 1, message, out)
    return tuple(out[rank][0]["value"])


def test_a_lost_workers_untrained_chunks_go_back_to_the_queue_with_their_tickets():
    session = CoordinatorSession(1, SessionConfig(4, make_policy("random", 4, 2).spec()))
    session.members.update(range(4))
    assert claim(session, 2, held=[2]) == (4, 1)  # its pre-assigned chunk 2 in flight, chunk 4 prefetched
    assert claim(session, 1, held=[1]) == (5, 2)
    assert claim(session, 2, held=[4]) == (6, 3)  # chunk 2 trained; 4 in flight, 6 prefetched
    session.depart(2, "killed", {})
    # its batch in flight (4: it may have trained it; the only chunk that can be trained twice) and the
    # prefetched one (6) come next, with the tickets claimed for them, before the queue goes on
    assert claim(session, 0, held=[0]) == (4, 1)
    assert claim(session, 3, held=[3]) == (6, 3)
    assert claim(session, 0, held=[4]) == (7, 4)


def test_a_membership_epochs_group_is_made_by_each_member_alone_and_a_pair_connects_without_the_others(tmp_path):
    """An admission's group (`Membership.epoch_group`) on gloo: no member waits for another to make it,
    and two members exchange on it while a third has not made it yet."""
    results = run_core_ranks(tmp_path, 3, "2", script="epoch_group_worker.py", timeout=60)
    for result in results:
        assert result["created"] < 1.0, result  # nobody waited for the late rank
        assert result["everyone"] == [6.0] * 4  # every member's sum, once the late one made it too
        assert result["epochs"] == [1] and result["epochs_after_retire"] == []
    for rank in (0, 1):
        assert results[rank]["pair"] == [3.0] * 4
        assert results[rank]["pair_seconds"] < 1.5, results[rank]  # the late rank (3 s) held nobody
        # a pair's first exchange on an epoch whose third member departed (a donor's first send to a
        # joiner after another member left): it connects, as a pair needs only its two members
        assert results[rank]["pair_after_departure"] == [3.0] * 4, results[rank]
    # a peer that made epoch 3's group (its addresses published) and died before its pair connected:
    # the first exchange with it ends incomplete once it is counted departed (1 s), whichever end of
    # the connection gloo gave each side (it waited for the peer 5 x the group's timeout before)
    for peer, (complete, seconds) in results[0]["dead_peers"].items():
        assert complete is False and seconds < 10.0, (peer, results[0])


class _EmptyStore:
    def check(self, keys: list[str]) -> bool:
        return False


@pytest.mark.parametrize(
    "pairwise, departed, raised, match",
    [
        # a third member left: the pair's wait goes on, to its bound (which names the peer's key)
        (True, {1}, CoordinationTimeout, r"waiting for ranks \[2\]"),
        (True, {2}, MemberLost, r"ranks \[2\] left the job"),  # the peer the key names (index 2) left
        (False, {1}, MemberLost, r"ranks \[1\] left the job"),  # a group's build waits for every member
    ],
)
def test_a_pairs_wait_for_its_peers_address_ends_only_with_that_peer_on_a_pairwise_group(
    pairwise, departed, raised, match
):
    store = RendezvousStore(_EmptyStore(), 0, (0, 1, 2), "a pair's connect", lambda: departed, 0.0, 0.3, pairwise)
    store.settle()
    with pytest.raises(raised, match=match):
        store.wait(["lightning_prague-s1-e2-0-1-2//cpu//0/2"], timedelta(seconds=0.3))


def test_a_rank_readmitted_since_an_epoch_is_gone_from_that_epochs_group_and_not_from_later_ones():
    """A member hears rank 1 depart, then its new process admitted in epoch 2: for epoch 1's group
    (whose rank 1 was the dead process) rank 1 is gone, for epoch 2's it is a member."""
    client = types.SimpleNamespace(rank=0, timeout=5.0, closed=False, credentials=CREDENTIALS, on_left_out=None)
    session = Session(client, 1, 4)  # type: ignore[arg-type]
    session.deliver({"t": "departed", "rank": 1, "reason": "its process ended", "members": [0, 2, 3], "s": 1})
    assert session.departed_for(1) == {1} and session.departed_for(2) == {1}
    admission = {"t": "members", "epoch": 2, "members": [0, 1, 2, 3], "joined": [1], "donor": 0, "s": 1}
    session.deliver(admission)
    assert 1 not in session.departed
    assert session.departed_for(1) == {1}  # epoch 1's rank 1 was its dead process
    assert session.departed_for(2) == set() and session.departed_for(3) == set()
