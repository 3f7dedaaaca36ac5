"""LaggedGossip on real processes (gloo), no Lightning: one round is W x, overlap changes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_core_ranks

from lightning_prague.core import make_topology

pytestmark = pytest.mark.timeout(120)

USER_SCHEDULE = [[{"members": [0, 1, 2], "self_weight": 0.5}, [3]], [[0, 3], {"members": [1, 2], "self_weight": 0.8}]]
CASES = {
    "complete": {"name": "complete"},
    "ring": {"name": "ring"},
    "one_peer_exp": {"name": "one_peer_exp"},
    "alternating_exp_ring": {"name": "alternating_exp_ring", "workers_per_node": 2},
    "user_schedule": {"schedule": USER_SCHEDULE},
    "prague_static": {"name": "static", "workers_per_node": 2},
}
STEPS, LR, DIM = 6, 0.3, 7


def reference_training(schedule, starts, rounds, steps):
    """x^{t+1} = W_t x^t - lr * grad(x^t) for ranks still stepping; idle rounds (and the drain) only mix."""
    x = torch.tensor(starts, dtype=torch.float64)
    targets = torch.stack([torch.arange(DIM, dtype=torch.float64) * (r + 1) for r in range(len(starts))])
    for t in range(rounds):
        stepping = torch.tensor([[1.0 if t < s else 0.0] for s in steps], dtype=torch.float64)
        x = schedule.mixing_matrix(t) @ x - LR * stepping * (x - targets)
    return x


@pytest.fixture(scope="module")
def gossip_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gossip")
    return run_core_ranks(tmp, 4, json.dumps(CASES), str(STEPS), script="gossip_worker.py")


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_round_is_w_x_and_overlap_gives_the_same_parameters(gossip_runs, case):
    spec = CASES[case]
    schedule = make_topology(spec.get("name", ""), 4, spec.get("workers_per_node", 1), spec.get("schedule"))
    starts = [r["start"] for r in gossip_runs]
    runs = [r[case] for r in gossip_runs]
    x = torch.tensor(starts, dtype=torch.float64)
    for r in range(schedule.period):
        got = torch.tensor([run["rounds"][r] for run in runs], dtype=torch.float64)
        torch.testing.assert_close(got, schedule.mixing_matrix(r) @ x, rtol=0, atol=1e-12)
    rounds = {run[kind]["rounds"] for run in runs for kind in ("overlapped", "blocking")}
    assert rounds == {STEPS + 1}, "equal step counts end the phase without idle rounds"
    expected = reference_training(schedule, starts, rounds.pop(), [STEPS] * 4)
    overlapped = torch.tensor([run["overlapped"]["params"] for run in runs], dtype=torch.float64)
    blocking = torch.tensor([run["blocking"]["params"] for run in runs], dtype=torch.float64)
    torch.testing.assert_close(overlapped, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(blocking, overlapped, rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_unlagged_gossip_takes_the_gradient_at_the_averaged_parameters(gossip_runs, case):
    """``lagged=False`` (Prague's blocking static schedule): y_0 = W_0 x^0, y_{t+1} = W_{t+1}(y_t - lr grad(y_t))."""
    spec = CASES[case]
    schedule = make_topology(spec.get("name", ""), 4, spec.get("workers_per_node", 1), spec.get("schedule"))
    runs = [r[case]["averaged_first"] for r in gossip_runs]
    assert {run["rounds"] for run in runs} == {STEPS + 1}
    targets = torch.stack([torch.arange(DIM, dtype=torch.float64) * (r + 1) for r in range(4)])
    x = schedule.mixing_matrix(0) @ torch.tensor([r["start"] for r in gossip_runs], dtype=torch.float64)
    for t in range(STEPS):
        x = schedule.mixing_matrix(t + 1) @ (x - LR * (x - targets))
    got = torch.tensor([run["params"] for run in runs], dtype=torch.float64)
    torch.testing.assert_close(got, x, rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_with_different_step_counts_end_the_phase_at_the_same_round(gossip_runs, case):
    spec = CASES[case]
    schedule = make_topology(spec.get("name", ""), 4, spec.get("workers_per_node", 1), spec.get("schedule"))
    runs = [r[case]["uneven"] for r in gossip_runs]
    steps = [STEPS + 2 * rank for rank in range(4)]
    rounds = {run["rounds"] for run in runs}
    assert len(rounds) == 1 and rounds.pop() <= max(steps) + 1 + 2 * (schedule.coverage + 1), runs
    expected = reference_training(schedule, [r["start"] for r in gossip_runs], runs[0]["rounds"], steps)
    got = torch.tensor([run["params"] for run in runs], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_consensus_error_of_known_replicas_is_exact_and_group_errors_match_the_group_means(gossip_runs):
    x = torch.tensor([r["start"] for r in gossip_runs], dtype=torch.float64)
    mean = x.mean(0)
    expected = float(((x - mean) ** 2).sum(1).mean() / (mean**2).sum())
    for r in gossip_runs:
        assert r["consensus_error"] == pytest.approx(expected, rel=1e-12)
    schedule = make_topology("complete", 4)
    for rank, run in enumerate(gossip_runs):  # one group of everybody: the group error is the rank's own term
        (error,) = run["complete"]["group_errors"]
        assert error == pytest.approx(float(((x[rank] - mean) ** 2).sum() / (mean**2).sum()), rel=1e-12)
    assert schedule.period == 1


def test_at_their_own_pace_fast_ranks_take_local_steps_and_no_round_is_mixed_in_part(gossip_runs):
    """`own_pace` on a ring, rank 3 slow: the others train on while their rounds wait for it (local
    steps), every rank ends the phase at one round, and each round took effect whole on every member:
    mixing is doubly stochastic, so the ranks' sum is their starting sum less every gradient step, to the
    last bit of float64 arithmetic (a round mixed in on one member and not its partner would break it)."""
    runs = [r["own_pace"] for r in gossip_runs]
    assert len({run["rounds"] for run in runs}) == 1, [run["rounds"] for run in runs]
    assert sum(run["local_steps"] for run in runs[:3]) > 0, [run["local_steps"] for run in runs]
    starts = torch.tensor([r["start"] for r in gossip_runs], dtype=torch.float64).sum(0)
    applied = torch.tensor([run["applied"] for run in runs], dtype=torch.float64).sum(0)
    final = torch.tensor([run["params"] for run in runs], dtype=torch.float64).sum(0)
    torch.testing.assert_close(final, starts - applied, rtol=0, atol=1e-10)


def test_phases_of_uneven_length_end_at_one_round_in_the_meeting_and_write_no_counter(gossip_runs):
    # the meeting that ends every strategy's phase ends gossip phases too: ranks that ran out of
    # steps serve the others with idle rounds, and all end at the round the release names
    phases = [run["phases"] for run in gossip_runs]
    assert len({tuple(p["ended_at"]) for p in phases}) == 1, [p["ended_at"] for p in phases]
    assert sum(p["idle_rounds"] for p in phases) > 0
    assert all(p["counter_keys"] == 0 for p in phases), "the end of a phase writes nothing to the counters"


def test_idle_rounds_that_take_no_effect_are_paced_and_the_others_run_back_to_back(monkeypatch):
    """A waiting worker's meeting polls every millisecond and serves an idle round at each poll whose
    round in flight is done. A round that took no effect (a member gone, no partner left) ends at once:
    the next one waits `IDLE_PAUSE_SECONDS`, instead of a round and a verdict per poll; a round that
    took effect (a live partner took part) is followed at once, so nobody waits on the pause."""
    from concurrent.futures import Future

    from lightning_prague.core.exchange import gossip
    from lightning_prague.core.exchange.gossip import IDLE_PAUSE_SECONDS, LaggedGossip, _InFlight

    class Group:  # a round's group: its members
        def __init__(self, members):
            self.members = members

    now = [100.0]
    monkeypatch.setattr(gossip.time, "monotonic", lambda: now[0])
    exchanger = object.__new__(LaggedGossip)
    exchanger._idle_issued, exchanger.idle_rounds = 0.0, 0
    done: Future = Future()
    done.set_result(None)
    effect = [False]

    def idle_round():
        members = [0, 1] if effect[0] is not None else [0]
        exchanger._flight = _InFlight(0, Group(members), applied=bool(effect[0]), future=done)  # type: ignore[arg-type]
        exchanger.idle_rounds += 1

    monkeypatch.setattr(exchanger, "_idle_round", idle_round)
    exchanger._flight = None

    def polls(count: int) -> int:
        before = exchanger.idle_rounds
        for _ in range(count):
            exchanger.serve()
            now[0] += 0.001
        return exchanger.idle_rounds - before

    assert polls(200) == round(0.2 / IDLE_PAUSE_SECONDS)  # rounds a member left: one per pause
    effect[0] = None  # no partner left in the group: the same
    assert polls(200) == round(0.2 / IDLE_PAUSE_SECONDS)
    effect[0] = True  # rounds with a live partner: one per poll, as before
    assert polls(200) == 200
