"""`WorkerStats` is shared by a worker's communication thread (which records) and its training thread
(which takes and resets): a take must never see a sum and a count that do not belong together."""

from __future__ import annotations

import sys
import threading

import torch

from lightning_prague.core.exchange.worker import WorkerStats


def test_group_errors_recorded_from_one_thread_and_taken_from_another_keep_sum_and_count_together():
    stats = WorkerStats()
    done = threading.Event()
    means: list[float] = []

    def record() -> None:
        for _ in range(5_000):
            stats.record_group_error(torch.tensor(0.5, dtype=torch.float64))
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a torn update would show
    try:
        recorder = threading.Thread(target=record)
        recorder.start()
        while not done.is_set():
            mean = stats.take_group_error()
            if mean is not None:
                means.append(mean)
        recorder.join()
    finally:
        sys.setswitchinterval(interval)
    last = stats.take_group_error()
    if last is not None:
        means.append(last)
    # every recorded error is 0.5, so every mean is exactly 0.5 unless a sum was taken without its count
    assert means and set(means) == {0.5}
    assert stats.take_group_error() is None and stats.group_error_count == 0


def test_the_mean_group_error_is_over_the_records_since_the_last_take():
    stats = WorkerStats()
    assert stats.take_group_error() is None
    for value in (0.1, 0.2, 0.6):
        stats.record_group_error(torch.tensor(value, dtype=torch.float64))
    assert abs(stats.take_group_error() - 0.3) < 1e-12
    stats.record_group_error(torch.tensor(0.7, dtype=torch.float64))
    assert stats.take_group_error() == 0.7
