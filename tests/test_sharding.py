"""The work-queue sampler: one pass over the data per epoch, shared out by speed, reshuffled per epoch."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from helpers import CREDENTIALS
from torch.utils.data import BatchSampler

from lightning_prague.core import ControlClient, ControlPlane, SessionConfig, make_policy
from lightning_prague.core.data.sharding import ChunkBatches, WorkQueueSampler
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.plane.server import MessageServer


@pytest.fixture()
def counters():
    """The counters of a control-plane session (served from a thread here), where training keeps the queue."""
    plane = ControlPlane()
    server = MessageServer(plane.handle, "127.0.0.1", CREDENTIALS)
    server.start()
    client = ControlClient(*server.address, rank=0, timeout=10, credentials=CREDENTIALS)
    session = client.open_session(1, SessionConfig(16, make_policy("random", 16, 2).spec()))
    yield session.counters
    client.close()
    server.close()


class _OthersClaiming:
    """`counters` for simulations whose ranks all share its one session: the control plane would see
    nobody else claiming and hand a rank that left the tail and stands by the queue's rest. Here the
    other simulated ranks are live and claim: a standby claim returns the queue's end, as it does
    while another member claims (`lightning_prague.core.plane.queue_end`)."""

    def __init__(self, counters) -> None:
        self.counters = counters

    def begin_claim(self, *args, standby=False, **kwargs):
        if standby:
            return SimpleNamespace(result=lambda: (kwargs["num"], None))
        return self.counters.begin_claim(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.counters, name)


def _interleaved(samplers, speeds):
    """Consume the samplers round-robin, sampler i taking speeds[i] chunks per turn."""
    iters = [iter(s) for s in samplers]
    taken = [[] for _ in samplers]
    alive = set(range(len(samplers)))
    while alive:
        for i in sorted(alive):
            for _ in range(speeds[i] * samplers[i].chunk_size):
                try:
                    taken[i].append(next(iters[i]))
                except StopIteration:
                    alive.discard(i)
                    break
    return taken


def test_every_index_once_per_epoch_and_fast_ranks_take_more(counters):
    samplers = [WorkQueueSampler(103, 4, r, 3, counters, seed=5, slow_ratio=0) for r in range(3)]
    taken = _interleaved(samplers, [1, 4, 4])
    flat = [i for part in taken for i in part]
    assert sorted(flat) == list(range(103)), "an index was lost or trained on twice"
    assert len(taken[1]) > 2 * len(taken[0]) and len(taken[2]) > 2 * len(taken[0])
    assert all(len(t) > 0 for t in taken), "every rank gets at least its first chunk"


def test_reshuffled_each_epoch_from_the_seed(counters):
    a = WorkQueueSampler(50, 5, 0, 2, counters, seed=1)
    b = WorkQueueSampler(50, 5, 1, 2, counters, seed=1)
    first = a.permutation()
    assert first == b.permutation(), "ranks must agree on the order without communicating"
    a.set_epoch(1)
    assert a.permutation() != first and sorted(a.permutation()) == list(range(50))
    assert WorkQueueSampler(50, 5, 0, 2, counters, shuffle=False).permutation() == list(range(50))


def test_has_no_length_so_trainers_cannot_schedule_per_rank_step_counts(counters):
    with pytest.raises(TypeError):
        len(WorkQueueSampler(50, 5, 0, 2, counters))


def test_too_small_a_dataset_is_a_clear_error(counters):
    with pytest.raises(ConfigurationError, match="fewer than the 8 workers"):
        WorkQueueSampler(20, 4, 0, 8, counters)


def test_only_a_much_slower_rank_leaves_the_tail_to_the_others(counters):
    sampler = WorkQueueSampler(1000, 10, 0, 8, counters)
    # others: 7 ranks at 0.05 s/chunk -> 140 chunks/s
    assert sampler.should_leave_tail(remaining=30, horizon=0.5, my_chunk_seconds=0.25, others_rate=140)
    assert not sampler.should_leave_tail(remaining=300, horizon=0.5, my_chunk_seconds=0.25, others_rate=140)
    # a rank as fast as the others never stops early, however little is left
    assert not sampler.should_leave_tail(remaining=1, horizon=0.1, my_chunk_seconds=0.05, others_rate=140)


class _AlwaysSlow(WorkQueueSampler):
    """Every rank believes it is the slow one and that the others will finish the epoch."""

    def should_leave_tail(self, remaining, horizon, my_chunk_seconds, others_rate):
        return True


def test_the_last_rank_taking_chunks_never_leaves_the_tail_to_nobody(counters):
    samplers = [_AlwaysSlow(200, 4, r, 4, counters, seed=2) for r in range(4)]
    for s in samplers:  # estimates as after a few claims, so the tail decision is taken
        s._my_seconds, s._others_rate = 1.0, 100.0
    taken = _interleaved(samplers, [1, 1, 1, 1])
    flat = [i for part in taken for i in part]
    assert sorted(flat) == list(range(200)), "every index is trained once even if every rank wants to leave"
    assert sum(s.chunks_left_to_others > 0 for s in samplers) == 3, [s.chunks_left_to_others for s in samplers]


class _LiveMembers:
    """The session's counters as a sampler sees them, its session knowing only `members` alive."""

    def __init__(self, counters, members: list[int]) -> None:
        self._counters = counters
        self.session = SimpleNamespace(members=members)

    def __getattr__(self, name):
        return getattr(self._counters, name)


def test_with_ranks_lost_in_the_epoch_the_last_live_rank_taking_chunks_does_not_leave(counters):
    """5 ranks, 3 of them lost in the epoch (they claim nothing after their first chunk): the 2 survivors
    both believe they are slow. One leaves the tail, the other does not, and together they train every
    chunk the queue hands out. The guard counted the epoch's 5 members, so both left and most of the
    epoch was trained by nobody (28 of 45 batches, under load, in `test_exactly_once.py`)."""
    survivors = [_AlwaysSlow(200, 4, r, 5, counters, seed=2) for r in (0, 3)]
    for s in survivors:
        s._store = _LiveMembers(counters, [0, 3])
        s._my_seconds, s._others_rate = 1.0, 100.0
    taken = _interleaved(survivors, [1, 1])
    assert sum(len(part) for part in taken) == (50 - 3) * 4  # every chunk but the lost ranks' first ones
    assert sum(s.chunks_left_to_others > 0 for s in survivors) == 1, [s.chunks_left_to_others for s in survivors]


class _CountingStore:
    """A store client that counts the operations a sampler sends."""

    def __init__(self, store):
        self.store, self.ops = store, 0

    def add(self, key, value):
        self.ops += 1
        return self.store.add(key, value)


def test_one_store_operation_per_claimed_chunk_tail_awareness_included(counters):
    samplers = [WorkQueueSampler(400, 4, r, 4, counters, seed=3) for r in range(4)]  # tail awareness on
    ticks = itertools.count()  # a clock that moves with the calls, not with the machine's load (a
    clients = []  # real one made the tail decisions, and so the reads, depend on it: 66 operations once)
    for s in samplers:
        clients.append(_CountingStore(counters))
        s._store = clients[-1]
        s.clock = lambda: next(ticks) * 0.01
    taken = _interleaved(samplers, [1, 5, 5, 5])  # rank 0 is 5x slower
    assert sorted(i for part in taken for i in part) == list(range(400))
    for s, client in zip(samplers, clients):
        # every chunk after the pre-assigned one is one claim; plus the claim that found the queue
        # dry (or the one 'left' report of a rank that left the tail to the others), plus one read
        # of the queue's position before the first estimate exists
        assert client.ops <= s.chunks_taken + 1, (s.rank, client.ops, s.chunks_taken)


def _run_epoch_on_a_clock(samplers, seconds_per_chunk):
    """Play one epoch on a simulated clock, as Lightning's loop drives a loader: each rank fetches
    a chunk ahead of the one it trains (prefetch). Returns each rank's trained chunks and the time
    its last one finished."""
    now = [0.0]
    for s in samplers:
        s.clock = lambda: now[0]
    iters = [iter(s) for s in samplers]

    def fetch(r):  # one chunk's indices, or None when the rank's loader is exhausted
        chunk = [i for _, i in zip(range(samplers[r].chunk_size), iters[r])]
        return chunk or None

    queued = {r: [c for c in (fetch(r), fetch(r)) if c] for r in range(len(samplers))}
    trained = {r: [] for r in queued}
    finish = dict.fromkeys(queued, 0.0)
    events = sorted((seconds_per_chunk[r], r) for r in queued if queued[r])
    while events:
        events.sort()
        now[0], r = events.pop(0)
        trained[r].append(queued[r].pop(0))
        finish[r] = now[0]
        more = fetch(r)
        if more:
            queued[r].append(more)
        if queued[r]:
            events.append((now[0] + seconds_per_chunk[r], r))
    return trained, finish


def test_a_slow_rank_leaves_the_tail_in_its_first_epoch_before_any_estimate(counters):
    samplers = [WorkQueueSampler(160, 4, r, 4, _OthersClaiming(counters), seed=4) for r in range(4)]
    trained, finish = _run_epoch_on_a_clock(samplers, [1.0, 0.2, 0.2, 0.2])  # rank 0 is 5x slower
    flat = [i for chunks in trained.values() for chunk in chunks for i in chunk]
    assert sorted(flat) == list(range(160)), "every index is trained once"
    # the pre-assigned chunk and the one prefetched with it, claimed before anything was known;
    # a third would keep the others waiting for it at the end of the epoch
    assert len(trained[0]) == 2, {r: len(c) for r, c in trained.items()}
    assert finish[0] <= max(finish[r] for r in (1, 2, 3)), finish


@pytest.mark.parametrize("slow", [1.0, 3.0])
def test_in_the_first_epoch_a_burst_of_claims_ahead_never_sends_a_fast_rank_out_of_the_tail(counters, slow):
    """A job's first epoch, no speeds exchanged yet: each rank's estimates come from intervals between
    its own claims, and one of them can catch the others' burst of first claims ahead. A rank as fast
    as the others took them for faster by half and left the tail (in 9 of 40 such epochs with a 3x
    slower rank, 35 of 40 with none; on the emulated cluster a fast replica sat idle for 0.85 s of a
    2 s epoch). Its own epoch's counts must say it is slow too: here no fast rank leaves, a 3x slower
    one still does, and every index is trained once."""
    for epoch in range(12):
        jitter = [1.0, 1.05, 0.95]
        seconds = [0.2 * jitter[(epoch + r) % 3] for r in range(3)] + [0.2 * slow]
        samplers = [WorkQueueSampler(24 * 4, 4, r, 4, _OthersClaiming(counters), seed=epoch) for r in range(4)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        trained, _ = _run_epoch_on_a_clock(samplers, seconds)
        flat = sorted(i for chunks in trained.values() for chunk in chunks for i in chunk)
        assert flat == list(range(24 * 4)), "every index is trained once"
        left = [s.chunks_left_to_others for s in samplers]
        assert left[:3] == [0, 0, 0], (epoch, left, {r: len(c) for r, c in trained.items()})
        if slow > 1:
            assert left[3] > 0 and len(trained[3]) == 2, (epoch, left, {r: len(c) for r, c in trained.items()})


def test_with_everyone_s_speeds_a_slow_rank_takes_only_its_first_chunk_of_a_short_epoch(counters):
    # 16 ranks, 45 chunks: the fast ranks empty the queue before rank 0 finishes one chunk, so
    # rank 0 never sees the queue running and cannot tell how fast the others are on its own
    samplers = [WorkQueueSampler(45 * 4, 4, r, 16, _OthersClaiming(counters), seed=5) for r in range(16)]
    seconds = [1.0] + [0.2] * 15
    first, _ = _run_epoch_on_a_clock(samplers, seconds)
    assert len(first[0]) == 2  # its first chunk and the one fetched with it
    shared = [s.seconds_per_chunk for s in samplers]
    assert shared[0] == pytest.approx(1.0) and all(s == pytest.approx(0.2) for s in shared[1:]), shared
    for s in samplers:  # as at the synchronization point that ends the epoch
        s.set_speeds(shared)
        s.set_epoch(1)
    trained, finish = _run_epoch_on_a_clock(samplers, seconds)
    flat = [i for chunks in trained.values() for chunk in chunks for i in chunk]
    assert sorted(flat) == list(range(45 * 4)), "every index is trained once"
    assert len(trained[0]) == 1, {r: len(c) for r, c in trained.items()}


def test_speeds_are_ignored_until_every_rank_has_one(counters):
    sampler = WorkQueueSampler(100, 4, 1, 3, counters)
    sampler.set_speeds([0.5, 0.0, 0.1])
    assert sampler.seconds_per_chunk == 0.0
    sampler.set_speeds([0.5, 0.1, 0.25])
    assert sampler.seconds_per_chunk == 0.1 and sampler._others_rate == pytest.approx(2 + 4)


class _WaitingClaims:
    """A control plane's counters whose claims take `wait` seconds of a simulated clock (as one that
    waits at an emptied queue for a hung member does), for `begin_claim` and `report`."""

    def __init__(self, now: list[float], wait: float) -> None:
        self.now, self.wait, self.next = now, wait, 1

    def answer(self):
        self.now[0] += self.wait
        self.next += 1
        return self.next, None

    def begin_claim(self, *args, **kwargs):  # sent ahead: the wait is the reply's (`ClaimInFlight.result`)
        return SimpleNamespace(result=self.answer)

    def report(self, *args, **kwargs):
        pass


def test_time_a_claim_waits_at_the_queue_is_not_counted_as_this_ranks_step_time():
    now = [0.0]
    sampler = WorkQueueSampler(40, 1, 0, 2, _WaitingClaims(now, wait=30.0), shuffle=False, slow_ratio=0.0)
    sampler.clock = lambda: now[0]
    indices = iter(sampler)
    for _ in range(6):  # each batch trains for 1 s of the clock, each claim waits 30 s
        next(indices)
        now[0] += 1.0
    assert sampler.seconds_per_chunk == pytest.approx(1.0)


class _RecordedClaims:
    """Counters that record when each claim is sent and when its answer is taken (`begin_claim`)."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        self.events, self.next = events, 1  # (chunk 0 is the rank's own, set aside)

    def begin_claim(
        self, cursor, first, tickets, ticketed, num, chunk=None, set_aside=None, park=False, standby=False, **more
    ):
        claimed, self.next = self.next, self.next + 1
        self.events.append(("sent", claimed))
        if more.get("reports"):
            self.events.append(("reports", claimed))
        return SimpleNamespace(result=lambda: (self.events.append(("taken", claimed)), (claimed, None))[1])

    def report(self, *args, **kwargs):
        pass


def test_once_it_timed_its_chunks_a_rank_claims_the_next_one_while_it_trains_this_one():
    """No round trip between two batches: the claim for the next chunk is in flight while the rank
    trains the one it holds; before it has an estimate of its speed (its first chunks), it claims
    only once a chunk is done, so that a slow rank takes nothing it could not finish in time."""
    events: list[tuple[str, int]] = []
    now = [0.0]
    sampler = WorkQueueSampler(12, 1, 0, 2, _RecordedClaims(events), shuffle=False, slow_ratio=0.0)
    sampler.clock = lambda: now[0]
    for index in sampler:  # one index per chunk; the trainer trains it for a second of the clock
        events.append(("trains", index))
        now[0] += 1.0
    trains = [index for kind, index in events if kind == "trains"]
    assert trains == list(range(12))  # every chunk once, in the queue's order here
    position = {event: i for i, event in enumerate(events)}
    # the first chunks: claimed after the one before was trained (no estimate yet)
    assert position[("sent", 1)] > position[("trains", 0)]
    assert position[("sent", 2)] > position[("trains", 1)]
    # then each claim is sent before the chunk before it trains, and taken after
    ahead = [c for c in range(3, 12) if position[("sent", c)] < position[("trains", c - 1)] < position[("taken", c)]]
    assert ahead == list(range(3, 12)), events
    assert events[-1] == ("taken", 12)  # the claim that found the queue's end, also sent ahead


class _ScriptedClaims:
    """Counters whose claims get the chunks of `script` in turn (a lost rank's given back among them)."""

    def __init__(self, script: list[int]) -> None:
        self.script = list(script)

    def begin_claim(self, *args, **kwargs):
        chunk = self.script.pop(0)
        return SimpleNamespace(result=lambda: (chunk, None))

    def report(self, *args, **kwargs):
        pass


def test_each_chunk_is_one_batch_the_short_last_one_too_and_what_comes_after_it():
    """The training loader's batches (`ChunkBatches`): one per chunk, whole. The epoch's short last
    chunk (5: one sample of 11) is a batch of its own, and chunk 2, which a lost rank gave back after
    it, is one too: PyTorch's `BatchSampler` would fill the short chunk's batch with chunk 2's first
    sample, and the batches after it would span two chunks (one reported trained while half of the
    next was in it). With `drop_last`, and for a sampler without chunks, PyTorch's batching stays."""
    sampler = WorkQueueSampler(11, 2, 0, 2, _ScriptedClaims([5, 2, 6]), shuffle=False, slow_ratio=0.0)
    batches = list(ChunkBatches(sampler, batch_size=2, drop_last=False))
    assert batches == [[0, 1], [10], [4, 5]], batches
    sampler = WorkQueueSampler(11, 2, 0, 2, _ScriptedClaims([5, 2, 6]), shuffle=False, slow_ratio=0.0)
    assert list(BatchSampler(sampler, batch_size=2, drop_last=False)) == [[0, 1], [10, 4], [5]]  # (PyTorch's)
    assert list(ChunkBatches(range(5), batch_size=2, drop_last=False)) == [[0, 1], [2, 3], [4]]


def test_a_claim_says_its_rank_reports_what_it_holds_where_the_strategy_fetches_after_the_step():
    """Where the strategy fetches each batch after the step before (`reports_while_parked`), a claim
    tells the control plane that its rank trains and reports the chunk it holds while the claim waits
    (`lightning_prague.core.plane.queue_end`); without it, no claim says so."""
    for reporting in (False, True):
        events: list[tuple[str, int]] = []
        sampler = WorkQueueSampler(11, 2, 0, 2, _RecordedClaims(events), shuffle=False, slow_ratio=0.0)
        sampler.reports_while_parked = reporting
        assert sorted(i for batch in ChunkBatches(sampler, 2, False) for i in batch) == list(range(11))
        sent = [chunk for kind, chunk in events if kind == "sent"]
        reports = [chunk for kind, chunk in events if kind == "reports"]
        assert sent and reports == (sent if reporting else []), events


def test_without_claims_ahead_each_claim_waits_for_its_chunk_to_be_trained():
    events: list[tuple[str, int]] = []
    sampler = WorkQueueSampler(6, 1, 0, 2, _RecordedClaims(events), shuffle=False, slow_ratio=0.0, claim_ahead=False)
    for index in sampler:
        events.append(("trains", index))
    position = {event: i for i, event in enumerate(events)}
    assert all(position[("sent", c)] > position[("trains", c - 1)] for c in range(1, 7)), events


def test_the_chunk_a_claim_in_flight_got_counts_as_held_for_a_checkpoint():
    """At a synchronization point the claim sent ahead has a chunk this rank holds: a checkpoint taken
    there lists it with the untrained ones, so that a resumed fit skips none; the iterator then goes on
    with that very chunk."""
    events: list[tuple[str, int]] = []
    now = [0.0]
    sampler = WorkQueueSampler(12, 1, 0, 2, _RecordedClaims(events), shuffle=False, slow_ratio=0.0)
    sampler.clock = lambda: now[0]
    indices = iter(sampler)
    for _ in range(5):
        next(indices)
        now[0] += 1.0
    sampler.untrained.popleft()  # (the trainer trained all but the last chunk handed out)
    while len(sampler.untrained) > 1:
        sampler.untrained.popleft()
    assert ("sent", 5) in events and ("taken", 5) not in events
    assert sampler.held() == [4, 5]
    assert next(indices) == 5 and events.count(("taken", 5)) == 1
