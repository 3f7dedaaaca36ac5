"""The training fetcher under the work queue looks for the next batch after a batch's step, not before."""

from __future__ import annotations

import pytest
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher, _PrefetchDataFetcher
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from lightning_prague.strategies.fetching import StepFirstFetcher, step_first


class Recorded:
    """Batches 0..n-1 without a length (as a work queue's loader), recording every batch taken from it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.taken: list[int] = []

    def __iter__(self):
        for batch in range(self.n):
            self.taken.append(batch)
            yield batch


def lightning_fetcher(data) -> _PrefetchDataFetcher:
    """Lightning's training fetcher as the fit loop leaves it after its set-up (one batch fetched ahead)."""
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(data))
    iter(fetcher)
    return fetcher


def test_the_next_batch_is_taken_only_once_the_batch_handed_out_was_trained():
    data = Recorded(3)
    fetcher = step_first(lightning_fetcher(data), accumulate_grad_batches=1)
    assert isinstance(fetcher, StepFirstFetcher)
    assert data.taken == [0]  # what Lightning's set-up fetched ahead is taken over, not fetched again
    handed = []
    for expected_last in (False, False, True):
        batch, _, _ = next(fetcher)
        handed.append(batch)
        assert data.taken == handed  # nothing beyond the batch in training
        assert not fetcher.done
        assert fetcher.look_ahead() is expected_last  # after its step: the next one, or the epoch's end
        assert fetcher.look_ahead() is expected_last  # (asked again: the same answer, nothing fetched)
    assert handed == [0, 1, 2] and data.taken == [0, 1, 2]
    assert fetcher.done
    with pytest.raises(StopIteration):
        next(fetcher)
    iter(fetcher)  # the next epoch: nothing is fetched before the trainer asks
    assert data.taken == [0, 1, 2] and not fetcher.done and fetcher.look_ahead() is False
    assert next(fetcher)[0] == 0 and data.taken == [0, 1, 2, 0]


def test_an_epoch_of_one_batch_ends_after_it():
    fetcher = step_first(lightning_fetcher(Recorded(1)), accumulate_grad_batches=1)
    assert next(fetcher)[0] == 0
    assert fetcher.look_ahead() is True


def test_lightnings_fetcher_stays_where_it_must_know_the_last_batch_before_its_step():
    ahead = lightning_fetcher(Recorded(3))
    assert step_first(ahead, accumulate_grad_batches=2) is ahead  # accumulation steps at the epoch's last batch
    sized = lightning_fetcher([0, 1, 2])
    assert sized.length == 3 and step_first(sized, accumulate_grad_batches=1) is sized  # never fetched ahead
    iterating = _DataLoaderIterDataFetcher()
    assert step_first(iterating, accumulate_grad_batches=1) is iterating  # training_step takes the iterator
