"""A discrete-event model of workers talking to the Group Generator, for exhaustive-ish property tests.

Workers compute, send ``ready``, then execute their inbox in order; a group item completes only
when every member has it at the head of its inbox and is executing its inbox (as the
point-to-point exchanges of a group sum do). The scheduler picks enabled actions at random. If
nothing is enabled while some worker is not finished, the protocol deadlocked.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from lightning_prague.core.plane.generator import GroupGenerator


@dataclass
class SimResult:
    groups: dict[int, tuple[int, ...]] = field(default_factory=dict)  # gid -> members
    executed: dict[int, list[int]] = field(default_factory=dict)  # rank -> gids in execution order
    steps: dict[int, int] = field(default_factory=dict)
    released: bool = False


class DeadlockError(AssertionError):
    pass


def simulate(
    generator: GroupGenerator, steps: dict[int, int], rng: random.Random, max_events: int = 200_000
) -> SimResult:
    world = generator.world_size
    inbox: dict[int, deque] = {r: deque() for r in range(world)}
    to_coordinator: deque = deque()
    state = {r: "compute" for r in range(world)}  # compute | wait_answer | wait_release | done
    pending_req: dict[int, int] = {}
    done_steps = dict.fromkeys(range(world), 0)
    result = SimResult(executed={r: [] for r in range(world)})
    req_counter = dict.fromkeys(range(world), 0)

    def consume_non_groups(r: int) -> None:
        while inbox[r] and state[r] in ("wait_answer", "wait_release"):
            item = inbox[r][0]
            if item["t"] == "group":
                return
            inbox[r].popleft()
            if item["t"] == "answer":
                assert state[r] == "wait_answer" and item["req"] == pending_req[r]
                if item["gid"] is not None:
                    assert item["gid"] in result.executed[r], "answer names a group the rank has not executed"
                state[r] = "compute"
            elif item["t"] == "release":
                assert state[r] == "wait_release"
                state[r] = "done"
                result.released = True
            elif item["t"] == "error":
                raise AssertionError(item["message"])

    for _ in range(max_events):
        for r in range(world):
            consume_non_groups(r)
        actions: list[tuple] = []
        if to_coordinator:
            actions.append(("coord",))
        for r in range(world):
            if state[r] == "compute":
                actions.append(("step", r))
        heads = {}
        for r in range(world):
            if state[r] in ("wait_answer", "wait_release") and inbox[r] and inbox[r][0]["t"] == "group":
                heads[r] = inbox[r][0]
        for r, item in heads.items():
            if r == min(item["members"]) and all(
                m in heads and heads[m]["gid"] == item["gid"] for m in item["members"]
            ):
                actions.append(("group", item))
        if not actions:
            if all(s == "done" for s in state.values()):
                result.steps = done_steps
                return result
            raise DeadlockError(f"deadlock: states={state} heads={ {r: h['gid'] for r, h in heads.items()} }")
        action = rng.choice(actions)
        if action[0] == "coord":
            out = generator.handle(to_coordinator.popleft())
            for r, items in out.items():
                inbox[r].extend(items)
        elif action[0] == "step":
            r = action[1]
            if done_steps[r] >= steps[r]:
                state[r] = "wait_release"
                to_coordinator.append({"op": "arrive", "rank": r, "sync": "end"})
            else:
                done_steps[r] += 1
                req_counter[r] += 1
                pending_req[r] = req_counter[r]
                state[r] = "wait_answer"
                to_coordinator.append({"op": "ready", "rank": r, "req": req_counter[r]})
        else:
            item = action[1]
            members = tuple(item["members"])
            assert set(item) <= {"t", "gid", "members", "version", "weights", "e"}, f"unexpected field in {item}"
            result.groups[item["gid"]] = members
            for m in members:
                inbox[m].popleft()
                result.executed[m].append(item["gid"])
    raise DeadlockError("simulation did not finish within the event budget (livelock?)")


def assert_consistent_order(result: SimResult) -> None:
    """Every member executed each of its groups exactly once, and any two ranks agree on their order."""
    for r, gids in result.executed.items():
        assert len(gids) == len(set(gids)), f"rank {r} executed a group twice"
        assert gids == sorted(gids), f"rank {r} executed groups out of global order: {gids}"
    for gid, members in result.groups.items():
        for m in members:
            assert gid in result.executed[m]


def simulate_first_ready(
    generator: GroupGenerator, step_time: list[float], horizon: float
) -> list[tuple[float, int, tuple[int, ...]]]:
    """Timed model of blocking Partial Reduce with instant communication.

    Worker ``r`` computes for ``step_time[r]``, reports ready, and waits for its answer; a group
    executes the moment it is formed. Returns ``(time, reports so far, members)`` for each group.
    """
    world = generator.world_size
    events = [(step_time[r], r) for r in range(world)]
    heapq.heapify(events)
    req = dict.fromkeys(range(world), 0)
    reports = 0
    groups: list[tuple[float, int, tuple[int, ...]]] = []
    while events:
        now, r = heapq.heappop(events)
        if now > horizon:
            break
        req[r] += 1
        reports += 1
        out = generator.handle({"op": "ready", "rank": r, "req": req[r], "version": req[r]})
        seen: set[int] = set()
        for rank, items in out.items():
            for item in items:
                if item["t"] == "group" and item["gid"] not in seen:
                    seen.add(item["gid"])
                    groups.append((now, reports, tuple(item["members"])))
                elif item["t"] == "answer":
                    heapq.heappush(events, (now + step_time[rank], rank))
    return groups


@dataclass
class Waves:
    """Groups issued while workers make requests, by wave (every worker's ``r``-th request is wave ``r``)."""

    groups: dict[int, list[frozenset[int]]] = field(default_factory=dict)  # wave -> groups its requests issued
    memberships: dict[int, int] = field(default_factory=dict)  # rank -> groups it was a member of
    requests: dict[int, int] = field(default_factory=dict)  # rank -> requests it made

    def conflicting_fraction(self, excluding: set[int] = frozenset()) -> float:
        """Of all groups (but those with a member in ``excluding``), the fraction that share a member
        with another such group of the same wave."""
        total = conflicting = 0
        for wave in self.groups.values():
            groups = [g for g in wave if not g & excluding]
            total += len(groups)
            conflicting += sum(any(g & h for j, h in enumerate(groups) if j != i) for i, g in enumerate(groups))
        return conflicting / total

    def groups_per_request(self, ranks: list[int]) -> float:
        """Groups each of ``ranks`` averaged in per request it made (exchanges per local step)."""
        return sum(self.memberships.get(r, 0) for r in ranks) / sum(self.requests[r] for r in ranks)


def request_waves(
    generator: GroupGenerator, steps: int, rng: random.Random, sigma: float = 0.2, slow: dict[int, float] | None = None
) -> Waves:
    """Timed requests with instant groups: worker ``r`` asks after every step, whose time is
    lognormal (``sigma``, median 1) times ``slow.get(r, 1)``, until it made ``steps`` requests."""
    world = generator.world_size
    slow = slow or {}
    events = [(rng.random(), r) for r in range(world)]
    heapq.heapify(events)
    waves = Waves(requests=dict.fromkeys(range(world), 0))
    while events:
        now, r = heapq.heappop(events)
        wave = waves.requests[r]
        waves.requests[r] += 1
        seen: set[int] = set()
        for items in generator.handle({"op": "ready", "rank": r, "req": wave + 1}).values():
            for item in items:
                if item["t"] == "group" and item["gid"] not in seen:
                    seen.add(item["gid"])
                    waves.groups.setdefault(wave, []).append(frozenset(item["members"]))
                    for m in item["members"]:
                        waves.memberships[m] = waves.memberships.get(m, 0) + 1
        if waves.requests[r] < steps:
            heapq.heappush(events, (now + rng.lognormvariate(0, sigma) * slow.get(r, 1.0), r))
    return waves


def propagation_delays(groups: list[tuple[float, int, tuple[int, ...]]], world: int) -> list[int]:
    """Time-respecting mixing of :func:`simulate_first_ready`'s groups, in ready reports.

    A worker's model as of a group it joins reaches another worker through a chain of groups in
    time order. For every such contribution that reached all workers, the reports between the
    group it entered in and the group that completed its spread.
    """
    heard = [[0] * world for _ in range(world)]  # heard[j][i]: newest contribution of i that reached j
    pending: list[deque[int]] = [deque() for _ in range(world)]
    delays: list[int] = []
    for _, reports, members in groups:
        for m in members:
            heard[m][m] = reports
            pending[m].append(reports)
        merged = [max(heard[m][i] for m in members) for i in range(world)]
        for m in members:
            heard[m] = list(merged)
        for i in range(world):
            everywhere = min(heard[j][i] for j in range(world))
            while pending[i] and pending[i][0] <= everywhere:
                delays.append(reports - pending[i].popleft())
    return delays
