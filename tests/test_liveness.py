"""The hang rule: a worker is judged by its own step times and its signs of life; a waiting, busy or
computing worker is not hung."""

from __future__ import annotations

import itertools
import threading
import time
import types

import pytest

from lightning_prague.core.client.activity import ThreadActivity, thread_cpu_seconds
from lightning_prague.core.client.beacon import Beacon
from lightning_prague.core.plane.liveness import HangDetector
from lightning_prague.core.protocol import HangRule


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def detector(timeout: float = 300.0) -> tuple[HangDetector, Clock]:
    clock = Clock()
    return HangDetector(HangRule(), timeout, clock=clock), clock


def run_steps(hangs: HangDetector, clock: Clock, rank: int, step: float, seconds: float, progress: int = 0) -> int:
    """`rank` beats once a second for `seconds`, training a batch every `step` seconds."""
    start = clock.now
    while clock.now - start < seconds:
        clock.now += 1.0
        progress += max(1, int(1.0 / step))
        hangs.beat(rank, progress, waiting=False, busy=False, step=step)
    return progress


def test_the_bound_follows_each_workers_own_step_time_and_is_60s_blocked_10s_silent_for_50ms_steps():
    rule = HangRule()
    assert rule.bound(0.05, busy=False, timeout=300.0) == 60.0
    assert rule.bound(0.25, busy=False, timeout=300.0) == 60.0  # 5x slower: same bound
    assert rule.bound(5.0, busy=False, timeout=300.0) == 100.0  # slow steps: a longer bound
    assert rule.bound(None, busy=False, timeout=300.0) == 300.0  # no step timed yet
    assert rule.bound(0.05, busy=True, timeout=300.0) == 300.0  # an epoch's end, a checkpoint
    assert rule.silence_bound(0.05, busy=False, timeout=300.0) == 10.0  # a frozen process: silent
    assert HangRule(floor=3.0).silence_bound(0.05, busy=False, timeout=300.0) == 3.0  # never above `floor`


def test_a_5x_slow_worker_is_never_hung_and_a_stalled_one_is_declared_after_its_bound():
    hangs, clock = detector()
    for rank in (0, 1):
        hangs.joined(rank)
    fast = slow = 0
    for _ in range(60):  # a minute of training: rank 1 is 5x slower, it still progresses every second
        clock.now += 1.0
        fast += 20
        slow += 4
        hangs.beat(0, fast, False, False, 0.05)
        hangs.beat(1, slow, False, False, 0.25)
        assert hangs.hung() == []
    for second in range(1, 62):  # rank 1 stops progressing, shows no sign of life; its beacon still beats
        clock.now += 1.0
        fast += 20
        hangs.beat(0, fast, False, False, 0.05)
        hangs.beat(1, slow, False, False, 0.25)
        found = hangs.hung()
        if second <= 60:
            assert found == []
    assert len(found) == 1 and found[0][0] == 1
    assert "no training progress for 61.0s and no sign of life for 61.0s" in found[0][1]
    assert "bound 60.0s from its step time 0.250s" in found[0][1]
    assert hangs.hung() == []  # reported once


def test_a_frozen_worker_is_declared_from_silence_and_a_waiting_one_is_not():
    hangs, clock = detector()
    for rank in (0, 1):
        hangs.joined(rank)
    run_steps(hangs, clock, 0, 0.05, 5)
    progress = run_steps(hangs, clock, 1, 0.05, 5)
    for _ in range(20):  # rank 0 waits on a peer (its progress stands still); rank 1 is SIGSTOPped
        clock.now += 1.0
        hangs.beat(0, 100, waiting=True, busy=False, step=0.05)
        found = hangs.hung()
        if found:
            break
    assert [rank for rank, _ in found] == [1] and "nothing heard from it" in found[0][1]
    assert progress > 0


def test_a_busy_worker_whose_beacon_beats_is_never_hung():
    hangs, clock = detector(timeout=60.0)
    hangs.joined(0)
    run_steps(hangs, clock, 0, 0.05, 3)
    hangs.beat(0, 999, waiting=False, busy=True, step=0.05)  # a long checkpoint starts
    for _ in range(120):  # its beacon thread beats through it: a busy worker is not hung
        clock.now += 1.0
        hangs.beat(0, 999, waiting=False, busy=True, step=0.05)
        assert hangs.hung() == []


def test_a_worker_that_computes_for_minutes_is_slow_and_only_a_livelock_hits_the_long_bound():
    hangs, clock = detector(timeout=600.0)
    hangs.joined(0)
    progress = run_steps(hangs, clock, 0, 0.05, 5)
    for _ in range(599):  # one step computes for ten minutes: no progress, but its thread is active
        clock.now += 1.0
        hangs.beat(0, progress, waiting=False, busy=False, step=0.05, active=True)
        assert hangs.hung() == []
    progress = run_steps(hangs, clock, 0, 0.05, 2, progress)  # it trains on
    assert hangs.hung() == []
    for _ in range(601):  # a livelock: active, never progressing
        clock.now += 1.0
        hangs.beat(0, progress, waiting=False, busy=False, step=0.05, active=True)
        found = hangs.hung()
        if found:
            break
    assert found[0][0] == 0 and "although its training thread is active" in found[0][1]


def test_a_silent_worker_that_uses_the_cpu_on_the_planes_host_is_computing_and_a_stopped_one_is_hung():
    hangs, clock = detector()
    cpu = {0: 1.0, 1: None}  # rank 0 holds the interpreter in one long call; rank 1 is SIGSTOPped
    hangs.probe = lambda rank: cpu[rank]
    for rank in (0, 1):
        hangs.joined(rank)
        run_steps(hangs, clock, rank, 0.05, 3)
    found = []
    for _ in range(40):
        clock.now += 1.0
        cpu[0] += 0.9
        found += hangs.hung()
    assert [rank for rank, _ in found] == [1] and "nothing heard from it" in found[0][1]


def test_a_busy_worker_that_goes_silent_gets_three_times_its_bound():
    # a cut link or a frozen process in a busy stretch (an epoch's end): not the session's timeout
    hangs, clock = detector(timeout=1800.0)
    hangs.joined(0)
    run_steps(hangs, clock, 0, 0.05, 3)
    hangs.beat(0, 999, waiting=True, busy=True, step=0.05)  # at a synchronization point
    clock.now += 29.0
    assert hangs.hung() == []
    clock.now += 2.0
    found = hangs.hung()
    assert found[0][0] == 0 and "nothing heard from it for 31.0s (bound 30.0s from 3 x its silent bound" in found[0][1]
    assert HangRule().silence_bound(None, True, 1800.0) == 1800.0  # no step timed yet: the long bound


def test_the_beacon_times_steps_without_waits_or_busy_stretches():
    beacon = Beacon(HangRule(), interval=60.0)
    beacon.bump()  # after setup: busy until now, no step timed
    assert beacon.step_seconds is None
    time.sleep(0.02)
    with beacon.waiting():  # a wait on peers is not part of the step
        time.sleep(0.2)
    beacon.bump()
    step = beacon.step_seconds
    assert step is not None and 0.015 <= step < 0.15
    beacon.set_busy()
    time.sleep(0.2)
    beacon.bump()  # the busy stretch is not a step
    assert beacon.step_seconds == step
    report = beacon.report()
    assert report["waiting"] and not report["busy"] and report["progress"] == 3
    assert not beacon.report()["waiting"]  # a wait is reported once


def test_the_beacon_beats_at_once_when_a_worker_starts_stepping():
    beats = []
    beacon = Beacon(HangRule(), interval=30.0)
    beacon.start(beats.append, "test-beacon")
    try:
        beacon.bump()
        time.sleep(0.01)
        beacon.bump()  # its first timed step: the control plane must know its bound now
        deadline = time.monotonic() + 5
        while not any(b["step"] is not None for b in beats) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(b["step"] is not None and not b["busy"] for b in beats), beats
    finally:
        beacon.stop()


@pytest.mark.parametrize("floor, factor", [(0.0, 20.0), (10.0, 0.0)])
def test_the_strategies_reject_a_hang_rule_that_is_not_positive(floor, factor):
    from lightning_prague import PartialAllReduceStrategy
    from lightning_prague.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="hang_timeout"):
        PartialAllReduceStrategy(hang_timeout=floor, hang_factor=factor)


def _activity_of(work, cpu_between: float = 0.0) -> list[bool]:
    """Three samples of a thread's signs of life while it runs `work(stop)`, 0.3 s apart; with
    `cpu_between`, each once the thread used that many CPU seconds since the previous one (up to 10 s:
    on two cores shared with the suite's other jobs a computing thread may get less than the share of
    0.3 s a sample asks for), against a share of the time between samples low enough for that wait."""
    stop = threading.Event()
    activity = ThreadActivity(cpu_share=cpu_between / 10.0) if cpu_between else ThreadActivity()
    ready = threading.Event()

    def run() -> None:
        activity.watch()
        ready.set()
        work(stop)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(5)
    samples = []
    try:
        activity.sample()
        for _ in range(3):
            used = thread_cpu_seconds(thread.native_id)
            time.sleep(0.3)
            deadline = time.monotonic() + 10.0
            while cpu_between and thread_cpu_seconds(thread.native_id) - used < cpu_between:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            samples.append(activity.sample())
    finally:
        stop.set()
        thread.join(5)
    return samples


def test_a_thread_that_computes_is_active_and_one_that_blocks_or_sleeps_in_a_loop_is_not():
    def compute(stop: threading.Event) -> None:
        while not stop.is_set():
            sum(i * i for i in range(1000))

    def block(stop: threading.Event) -> None:
        stop.wait()

    def sleep_in_a_loop(stop: threading.Event) -> None:  # the demo's `hang` fault
        while not stop.is_set():
            time.sleep(1.0)

    assert all(_activity_of(compute, cpu_between=0.05))
    assert not any(_activity_of(block))
    assert not any(_activity_of(sleep_in_a_loop))


def test_a_stack_that_moves_without_cpu_is_a_polling_loop_not_a_sign_of_life(monkeypatch):
    """A thread that sleeps in a loop is caught between two sleeps now and then (its stack differs
    from the last sample's) but uses no CPU: that alone once made a hung step look alive for one
    more hang bound. Samples are played from a script: (CPU seconds, stack) per sample."""
    from lightning_prague.core.client import activity as module

    script = iter([(1.0, "sleep"), (1.0, "loop"), (1.0, "sleep"), (1.01, "sleep"), (1.02, "loop"), (1.02, "sleep")])
    current: list = [None]

    def read_cpu(native_id):
        current[0] = next(script)
        return current[0][0]

    monkeypatch.setattr(module, "thread_cpu_seconds", read_cpu)
    monkeypatch.setattr(module, "stack_signature", lambda ident: ((hash(current[0][1]), 0),))
    seconds = itertools.count()
    monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=lambda: float(next(seconds))))
    activity = ThreadActivity(cpu_share=0.5)  # a sample a second: CPU alone never counts here
    activity.watch()
    samples = [activity.sample() for _ in range(6)]
    # moved without CPU (twice); no move with CPU; moved with CPU; moved without CPU
    assert samples == [False, False, False, False, True, False]


def test_a_busy_device_is_a_sign_of_life():
    activity = ThreadActivity(device_busy=lambda: True)
    activity.watch()
    activity.sample()
    assert activity.sample()
    assert not ThreadActivity(device_busy=lambda: False).sample()  # nothing watched, an idle device
