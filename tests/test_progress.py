"""Global progress without processes: boundaries, and the protocol that meets them (issue 11).

The simulation replays the rule of :meth:`Boundary.due` for workers that fetch one batch ahead (a
ticket is claimed when a batch is fetched) and train at random relative speeds: every worker must
meet every boundary exactly once, in the same order, and at each one exactly the batches with
tickets up to it must have been trained.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_prague.core.data.progress import ENDED, Boundary, ProgressSchedule
from lightning_prague.core.errors import ConfigurationError


def test_boundaries_of_validation_checkpoints_and_budget():
    schedule = ProgressSchedule(4, 4, budget=120, validate_every=28, checkpoint_every=(40,))
    points = list(schedule.boundaries(0, None))
    assert [(b.batches, b.step, b.validate, b.checkpoint) for b in points] == [
        (28, 7, True, False),
        (40, 10, False, True),
        (56, 14, True, False),
        (80, 20, False, True),
        (84, 21, True, False),
        (112, 28, True, False),
        (120, 30, False, True),
    ]
    # within an epoch of known length, the ones in its last `tail` batches merge into its end
    merged = list(schedule.boundaries(0, 48, tail=8))
    assert [(b.batches, b.validate, b.checkpoint) for b in merged] == [(28, True, False), (40, False, True)]
    merged = list(ProgressSchedule(4, 4, validate_every=12).boundaries(0, 48, tail=16))
    assert [(b.batches, b.step, b.validate) for b in merged] == [(12, 3, True), (24, 6, True), (48, 12, True)]
    # validation counted from each epoch's start (check_val_every_n_epoch set)
    per_epoch = ProgressSchedule(4, 4, validate_every=20, validate_in_epoch=True)
    assert [b.batches for b in per_epoch.boundaries(48, 96)] == [68, 88]


def test_an_interval_shorter_than_one_batch_per_worker_is_rejected():
    with pytest.raises(ConfigurationError, match="closer than one batch per worker"):
        ProgressSchedule(8, 8, validate_every=4)


def simulate(world: int, end: int, schedule: ProgressSchedule, seed: int, ahead: bool = False) -> dict[int, list[int]]:
    """`ahead`: a worker also claims the ticket of the batch after its prefetched one while its next
    boundary is more than two of its steps away (`ProgressLoader._may_claim_ahead`)."""
    rng = random.Random(seed)
    speed = [rng.choice([1, 1, 5]) for _ in range(world)]
    counter = 0
    queue: dict[int, list[int]] = {r: [] for r in range(world)}
    trained: set[int] = set()
    met: dict[int, list[int]] = {r: [] for r in range(world)}
    boundaries = list(schedule.boundaries(0, end, tail=(3 if ahead else 2) * world))
    gap = dict.fromkeys(range(world), world)  # tickets claimed between a worker's last two
    position = dict.fromkeys(range(world), 0)  # index of each worker's next boundary
    waiting: dict[int, int] = {}  # worker -> boundary it waits at
    finished: set[int] = set()
    progress = dict.fromkeys(range(world), 0.0)

    def fetch(rank: int) -> None:
        nonlocal counter
        if counter < end:
            counter += 1
            if queue[rank]:
                gap[rank] = counter - queue[rank][-1]
            queue[rank].append(counter)

    for rank in range(world):
        fetch(rank)
    for rank in range(world):
        fetch(rank)  # the prefetched batch
    while len(finished) < world:
        active = [r for r in range(world) if r not in waiting and r not in finished]
        if not active:  # everyone waits at the same boundary: check it and release
            # nobody may have ended its epoch while others wait at a boundary (it would never come)
            assert len(set(waiting.values())) == 1 and not finished, (waiting, finished)
            point = next(iter(waiting.values()))
            assert trained == set(range(1, point + 1)), f"at {point}: trained {sorted(trained)}"
            finished.update(r for r in waiting if not queue[r])
            waiting.clear()
            continue
        rank = min(active, key=lambda r: progress[r] + speed[r] * rng.random())
        progress[rank] += speed[rank]
        ticket = queue[rank].pop(0)  # train it
        trained.add(ticket)
        if queue[rank]:
            fetch(rank)  # the batch after the next is fetched when the next one starts
        i = position[rank]
        if (
            ahead
            and len(queue[rank]) == 2
            and (i >= len(boundaries) or boundaries[i].batches - queue[rank][-1] > 2 * gap[rank])
        ):
            fetch(rank)  # and the one after it, its ticket claimed ahead
        following = queue[rank][0] if queue[rank] else None
        i = position[rank]
        boundary = boundaries[i] if i < len(boundaries) else None
        if boundary is not None and boundary.due(following, end if following is None else None):
            met[rank].append(boundary.batches)
            position[rank] += 1
            waiting[rank] = boundary.batches
        elif following is None:
            finished.add(rank)
    return met


@settings(max_examples=150, deadline=None)
@given(
    world=st.integers(2, 8),
    batches=st.integers(8, 120),
    every=st.integers(1, 6),
    seed=st.integers(0, 10**6),
)
@pytest.mark.parametrize("ahead", [False, True], ids=["fetched", "claimed-ahead"])
def test_every_worker_meets_every_boundary_once_with_exactly_the_batches_before_it(world, batches, every, seed, ahead):
    schedule = ProgressSchedule(world, world, validate_every=every * world)
    end = max(batches, world)
    met = simulate(world, end, schedule, seed, ahead)
    expected = [b.batches for b in schedule.boundaries(0, end, tail=(3 if ahead else 2) * world)]
    assert all(points == expected for points in met.values())


def test_due_rule():
    boundary = Boundary(40, 10)
    assert boundary.due(41, None) and not boundary.due(40, None)
    assert boundary.due(None, 48) and boundary.due(None, 40) and not boundary.due(None, 39)


class _CountingStore:
    """A counter table whose adds are answered later (`begin_add`), logging when each is sent and
    answered, and when the loader handed a batch over."""

    def __init__(self) -> None:
        self.value = 0
        self.log: list[str] = []
        self.keys: dict[str, str] = {}

    def add(self, key: str, amount: int) -> int:
        if key != "progress/0/claims":  # (the stream's end: who ended it)
            self.keys[key] = str(int(self.keys.get(key, 0)) + amount)
            return int(self.keys[key])
        return self.begin_add(key, amount)()

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value

    def get(self, key: str) -> bytes:
        return self.keys[key].encode()

    def wait(self, keys, timeout) -> None:
        assert all(key in self.keys for key in keys), keys

    def begin_add(self, key: str, amount: int):
        self.value += amount
        value = self.value
        self.log.append(f"sent {value}")

        def answer() -> int:
            self.log.append(f"answered {value}")
            return value

        return answer


def _loader(store: _CountingStore, boundary):
    from lightning_prague.core.data.progress import ProgressCounter
    from lightning_prague.core.data.progress_loader import ProgressLoader

    counter = ProgressCounter(store=store, timeout=1.0, rank=0, world_size=2)
    loader = ProgressLoader(list(range(12)), counter, lambda: 0)
    loader.next_boundary = boundary
    loader.arm()
    return loader


def test_a_batchs_ticket_is_claimed_a_batch_ahead_so_its_round_trip_overlaps_training():
    """A stream's per-batch ticket: the claim for the next batch leaves before this batch is handed over
    (the trainer trains it meanwhile), is answered when that next batch is handed over, and the tickets
    are those claimed one at a time."""
    store = _CountingStore()
    loader = _loader(store, lambda: None)  # no synchronization point ahead
    handed = []
    for batch in loader:
        store.log.append(f"handed {batch}")
        handed.append(loader.batch_trained())
    assert handed == [1, *range(3, 14)]  # its set-aside first ticket, then the counter's, in order
    # the claim of batch 2 (value 2) left before batch 1 was handed over, and was answered just before batch 2
    assert store.log[:5] == ["sent 1", "handed 0", "answered 1", "sent 2", "handed 1"]
    # one claim per batch after the first, none wasted at the stream's end (then the end's mark)
    assert [line for line in store.log if line.startswith("sent")][-2:] == ["sent 11", f"sent {ENDED + 11}"]


def test_near_a_synchronization_point_a_ticket_is_not_claimed_ahead():
    """A rank holds at most one ticket beyond the next boundary, and within two of its steps of the boundary
    claims a ticket only as the batch is handed over: a ticket claimed ahead there would be one more batch of
    this rank's before the meeting (a slow rank's, that the others wait for)."""
    store = _CountingStore()
    loader = _loader(store, lambda: 8)
    for batch in loader:
        store.log.append(f"handed {batch} ticket {loader.current_ticket}")
        loader.batch_trained()
        if batch == 4:
            break
    # tickets 1, 3, 4, 5, 6 (world 2, no other rank claims: one ticket between this rank's steps)
    at = store.log.index("handed 3 ticket 5")
    assert store.log[at - 1] == "sent 4"  # ticket 6's claim, sent ahead: 8 - 5 > 2 x 1
    at = store.log.index("handed 4 ticket 6")
    assert store.log[at - 1] == "answered 4" and store.log[at + 1 :] == []  # 8 - 6 = 2: nothing sent ahead


def test_a_batch_held_back_at_the_step_budget_says_the_epoch_goes_on():
    """With the budget spent inside an epoch, the loader hands the batch it fetched over untrained and
    ends: Lightning's fetcher, a batch ahead, then takes that batch for the epoch's last. The loader
    says the epoch goes on past the budget, so that a checkpoint taken there resumes inside the epoch
    (`PragueStrategyBase.save_checkpoint`; it once resumed at the next epoch, under load)."""
    store = _CountingStore()
    loader = _loader(store, lambda: None)
    loader.counter.budget = 5
    handed = []
    for batch in loader:
        handed.append((batch, loader.current_ticket))
        if loader.current_ticket is not None:
            assert not loader.held_back_at_budget
            loader.batch_trained()
    assert handed[-1][1] is None and [t for _, t in handed[:-1]] == [1, 3, 4, 5]
    assert loader.held_back_at_budget  # the fifth batch exists: the epoch is not over
    assert len(handed) < 12
