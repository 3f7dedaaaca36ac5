"""The training loop's fetcher under the work queue: the next batch is looked for after a batch's step, not before.

Lightning's fetcher for a loader without a length (`_PrefetchDataFetcher`) fetches the batch after the
current one *before* training the current one, to tell whether it is the epoch's last. Under the work
queue that fetch is a claim, and at the queue's end a claim parks at the control plane while a live
member may still give chunks back (`lightning_prague.core.plane.queue_end`). So every fast rank's last
batch of an epoch waited, untrained, until the slowest member had trained its own last chunk, and was
trained only then: one step of every fast rank per epoch spent after the slowest one's.

`StepFirstFetcher` hands the trainer one batch at a time and looks for the next one once the batch's
step is over (`look_ahead`): at the strategy's optimizer step, right after the batch is reported trained
and before the step's exchange work (which folds in what a wait served and puts a replica's model
together after it), or, where no optimizer step came, where Lightning first asks whether the epoch's
batches are done (the epoch loop's `_num_ready_batches_reached`, `global_progress`). A wait at the
queue's end is then spent with this rank's last batch trained (and reported), beside the slowest
member's last chunk instead of after it. Lightning's own readers of the answer
(`batch_progress.is_last_batch`, this fetcher's `done`) get it before the batch's `on_train_batch_end`
hooks, validation and the epoch's end, which read it.

Not used where Lightning must know the epoch's last batch before its step: with gradient accumulation
(the last batch steps the optimizer), or a `training_step` that takes the `dataloader_iter` (another
fetcher). There Lightning's fetcher stays.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher
from typing_extensions import override

log = logging.getLogger(__name__)


class StepFirstFetcher(_DataFetcher):
    """One batch at a time; the next is fetched by `look_ahead`, after the batch handed out was trained."""

    def __init__(self) -> None:
        super().__init__()
        #: the batch `look_ahead` fetched (at most one), handed out next
        self._ahead: list[Any] = []
        #: a batch was handed out and the one after it not looked for yet
        self._owed = False

    @classmethod
    def taking_over(cls, fetcher: _PrefetchDataFetcher) -> StepFirstFetcher:
        """This fetcher in place of Lightning's `fetcher`, with its loader, its iterator and the batches
        it fetched already (its set-up fetched one ahead)."""
        taken = cls()
        taken._combined_loader = fetcher._combined_loader
        taken.iterator = fetcher.iterator
        taken.fetched = fetcher.fetched
        taken.length = fetcher.length
        taken._start_profiler = fetcher._start_profiler
        taken._stop_profiler = fetcher._stop_profiler
        taken._ahead = list(fetcher.batches)
        taken.done = fetcher.done and not taken._ahead
        return taken

    @override
    def __next__(self) -> Any:
        if self._ahead:
            batch = self._ahead.pop(0)
        elif self.done:
            raise StopIteration
        else:
            batch = super().__next__()  # (its end sets `done`)
        self._owed = True
        return batch

    def look_ahead(self) -> bool:
        """The batch handed out last was trained: fetch the next one (kept for `__next__`); whether there is
        none, i.e. the batch trained was the epoch's last. Once per batch handed out (later calls answer
        the same)."""
        if self._owed:
            self._owed = False
            if not self._ahead and not self.done:
                try:
                    self._ahead.append(super().__next__())
                except StopIteration:
                    log.debug("fetcher: the batch just trained was the epoch's last")
        return self.done and not self._ahead

    @override
    def reset(self) -> None:
        super().reset()
        self._ahead = []
        self._owed = False


def step_first(fetcher: Any, accumulate_grad_batches: int) -> Any:
    """`fetcher` (the fit loop's, just made) or a `StepFirstFetcher` in its place where Lightning need not
    know the epoch's last batch before its step (see the module docstring)."""
    if type(fetcher) is not _PrefetchDataFetcher or fetcher.length is not None or accumulate_grad_batches != 1:
        return fetcher  # (a loader with a length is not fetched ahead)
    return StepFirstFetcher.taking_over(fetcher)
