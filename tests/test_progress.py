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

from lightning_prague.core.data.progress import Boundary, ProgressSchedule
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


def simulate(world: int, end: int, schedule: ProgressSchedule, seed: int) -> dict[int, list[int]]:
    rng = random.Random(seed)
    speed = [rng.choice([1, 1, 5]) for _ in range(world)]
    counter = 0
    queue: dict[int, list[int]] = {r: [] for r in range(world)}
    trained: set[int] = set()
    met: dict[int, list[int]] = {r: [] for r in range(world)}
    boundaries = list(schedule.boundaries(0, end, tail=2 * world))
    position = dict.fromkeys(range(world), 0)  # index of each worker's next boundary
    waiting: dict[int, int] = {}  # worker -> boundary it waits at
    finished: set[int] = set()
    progress = dict.fromkeys(range(world), 0.0)

    def fetch(rank: int) -> None:
        nonlocal counter
        if counter < end:
            counter += 1
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
def test_every_worker_meets_every_boundary_once_with_exactly_the_batches_before_it(world, batches, every, seed):
    schedule = ProgressSchedule(world, world, validate_every=every * world)
    end = max(batches, world)
    met = simulate(world, end, schedule, seed)
    expected = [b.batches for b in schedule.boundaries(0, end, tail=2 * world)]
    assert all(points == expected for points in met.values())


def test_due_rule():
    boundary = Boundary(40, 10)
    assert boundary.due(41, None) and not boundary.due(40, None)
    assert boundary.due(None, 48) and boundary.due(None, 40) and not boundary.due(None, 39)
